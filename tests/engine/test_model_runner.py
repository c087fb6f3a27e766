"""Our forward equals transformers' reference forward (fp32, max abs diff <= 1e-4)."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from spin.engine.model_runner import ForwardItem, ModelRunner

TOL = 1e-4


@torch.inference_mode()
def reference_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def check_runner(path: Path, seqs: list[list[int]], tree_tokens=(7, 8, 9, 10), tree_parents=(-1, -1, 0, 1)) -> None:
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    runner = ModelRunner(path, num_slots=4, max_len=256)
    slots = [runner.cache.admit(f"r{i}") for i in range(len(seqs))]
    # 1. ragged prefill: different prompt lengths in one forward
    prompts = [s[:-3] for s in seqs]
    logits = runner.forward([ForwardItem(sl, tuple(p)) for sl, p in zip(slots, prompts)])
    for i, p in enumerate(prompts):
        full = ref(input_ids=torch.tensor([p])).logits[0]
        assert (logits[i, :len(p)] - full).abs().max() <= TOL
        runner.cache.commit(slots[i], len(p))
    # 2. decode steps, one token per request, contexts of different lengths
    for step in range(3):
        out = runner.forward([ForwardItem(sl, (s[len(p) + step],))
                              for sl, s, p in zip(slots, seqs, prompts)])
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            want = reference_last_logits(ref, s[:len(p) + step + 1])
            assert (out[i, 0] - want).abs().max() <= TOL
            runner.cache.commit(slots[i], len(p) + step + 1)
    # 3. a token tree beside a chain: each node sees the context and its ancestors only
    items = [ForwardItem(slots[0], tree_tokens, tree_parents), ForwardItem(slots[1], (5, 6))]
    out = runner.forward(items)
    ctx0, ctx1 = seqs[0], seqs[1]
    paths: list[list[int]] = []
    for node, (tok, par) in enumerate(zip(tree_tokens, tree_parents)):
        paths.append(([] if par < 0 else paths[par]) + [tok])
        want = reference_last_logits(ref, ctx0 + paths[-1])
        assert (out[0, node] - want).abs().max() <= TOL, f"tree node {node}"
    assert (out[1, 1] - reference_last_logits(ref, ctx1 + [5, 6])).abs().max() <= TOL
    # 4. rollback: the tree left no trace once the slot is rolled back and rescored
    again = runner.forward([ForwardItem(slots[0], (tree_tokens[1],))])
    assert (again[0, 0] - reference_last_logits(ref, ctx0 + [tree_tokens[1]])).abs().max() <= TOL


def test_matches_transformers_on_demo_models(family_dir: Path, tokenizer) -> None:
    texts = ["def read(path):\n    with open(path) as f:\n        return f.read()\n",
             "The program reads its configuration from the file named by the option.",
             '{"id": 7, "name": "ada"}\n{"id": 8, "name": "alan"}']
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    for name in ("target", "draft-structured"):
        check_runner(family_dir / name, seqs)


@pytest.mark.parametrize("config", [
    Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128),
    MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
                  sliding_window=None),
], ids=["qwen2-gqa-bias", "mistral-mqa"])
def test_matches_transformers_on_other_llama_family_configs(tmp_path: Path, config) -> None:
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (12, 7, 20)]
    check_runner(tmp_path, seqs)


def test_context_overflow_is_refused(family_dir: Path) -> None:
    runner = ModelRunner(family_dir / "draft-structured", num_slots=1, max_len=16)
    slot = runner.cache.admit("a")
    with pytest.raises(ValueError, match="exceed 16"):
        runner.forward([ForwardItem(slot, tuple(range(17)))])


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
                                     ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(tmp_path)
