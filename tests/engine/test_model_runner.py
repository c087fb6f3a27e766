"""Our forward equals transformers' reference forward (fp32, max abs diff <= 1e-4), through
contiguous blocks (a view) and scattered ones (gathered) alike."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, Qwen2Config

from spin.engine.kv_cache import CacheFull
from spin.engine.model_runner import ForwardItem, ModelRunner, RunnerConfig, describe

TOL = 1e-4
SMALL = 16 << 20  # KV cache budget of the runners below (pages are touched as blocks are used)


@torch.inference_mode()
def reference_last_logits(model, ids: list[int]) -> torch.Tensor:
    return model(input_ids=torch.tensor([ids])).logits[0, -1]


def check_runner(path: Path, seqs: list[list[int]], tree_tokens=(7, 8, 9, 10),
                 tree_parents=(-1, -1, 0, 1)) -> None:
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # small blocks: the decode steps below interleave the sequences' blocks (the gather path)
    runner = ModelRunner(path, max_seqs=4, max_model_len=128, kv_cache_bytes=SMALL, block_size=4)
    ids = [runner.cache.blocks.admit(f"r{i}") for i in range(len(seqs))]
    # 1. ragged prefill: different prompt lengths in one forward
    prompts = [s[:-3] for s in seqs]
    logits = runner.forward([ForwardItem(sq, tuple(p)) for sq, p in zip(ids, prompts)])
    for i, p in enumerate(prompts):
        full = ref(input_ids=torch.tensor([p])).logits[0]
        assert (logits[i, :len(p)] - full).abs().max() <= TOL
        runner.cache.commit(ids[i], len(p))
    # 2. decode steps, one token per request, contexts of different lengths
    for step in range(3):
        out = runner.forward([ForwardItem(sq, (s[len(p) + step],))
                              for sq, s, p in zip(ids, seqs, prompts)])
        for i, (s, p) in enumerate(zip(seqs, prompts)):
            want = reference_last_logits(ref, s[:len(p) + step + 1])
            assert (out[i, 0] - want).abs().max() <= TOL
            runner.cache.commit(ids[i], len(p) + step + 1)
    assert any(runner.cache.blocks.contiguous(sq) is None for sq in ids)
    # 3. a token tree beside a chain: each node sees the context and its ancestors only
    items = [ForwardItem(ids[0], tree_tokens, tree_parents), ForwardItem(ids[1], (5, 6))]
    out = runner.forward(items)
    ctx0, ctx1 = seqs[0], seqs[1]
    paths: list[list[int]] = []
    for node, (tok, par) in enumerate(zip(tree_tokens, tree_parents)):
        paths.append(([] if par < 0 else paths[par]) + [tok])
        want = reference_last_logits(ref, ctx0 + paths[-1])
        assert (out[0, node] - want).abs().max() <= TOL, f"tree node {node}"
    assert (out[1, 1] - reference_last_logits(ref, ctx1 + [5, 6])).abs().max() <= TOL
    # 4. rollback: the tree left no trace once the sequence is rolled back and rescored
    runner.cache.rollback(ids[0], len(ctx0))
    again = runner.forward([ForwardItem(ids[0], (tree_tokens[1],))])
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


def _grow(runner: ModelRunner, seq: int, prompt: list[int], steps: list[int],
          other: tuple[int, list[int]] | None = None) -> list[torch.Tensor]:
    """Prefill ``prompt``, then decode ``steps`` one token at a time (each forward alone);
    ``other`` = (sequence, tokens) grows by one token before each of them (interleaving blocks).
    The logits of every forward's last token."""
    out = []
    for i, toks in enumerate([prompt] + [[t] for t in steps]):
        if other is not None:
            oseq, otoks = other
            runner.forward([ForwardItem(oseq, (otoks[i],))])
            runner.cache.commit(oseq, runner.cache.lengths[oseq] + 1)
        out.append(runner.forward([ForwardItem(seq, tuple(toks))])[0, -1])
        runner.cache.commit(seq, runner.cache.lengths[seq] + len(toks))
    return out


def test_scattered_blocks_give_the_logits_of_contiguous_ones(family_dir: Path, target) -> None:
    """The same tokens through one run of blocks (a view) and through blocks interleaved with
    another growing sequence (gathered through the block table): equal logits."""
    runner = ModelRunner(family_dir / "target", max_seqs=2, max_model_len=128,
                         kv_cache_bytes=SMALL, block_size=4)
    blocks = runner.cache.blocks
    gen = torch.Generator().manual_seed(4)
    prompt, steps, noise = (torch.randint(1, 4000, (n,), generator=gen).tolist()
                            for n in (6, 14, 16))
    a = blocks.admit("alone")
    alone = _grow(runner, a, prompt, steps)
    assert blocks.contiguous(a) is not None and len(blocks.tables[a]) == 5
    blocks.free(a)
    b, a = blocks.admit("noise"), blocks.admit("mixed")
    mixed = _grow(runner, a, prompt, steps, other=(b, noise))
    assert blocks.contiguous(a) is None and blocks.contiguous(b) is None
    for i, (x, y) in enumerate(zip(alone, mixed)):
        assert (x - y).abs().max() <= 1e-5, f"step {i}"
    ids = prompt + steps
    want = reference_last_logits(target, ids[:-1])  # the last forward fed ids[-1]: its logits
    assert (mixed[-2] - want).abs().max() <= TOL
    assert (mixed[-1] - reference_last_logits(target, ids)).abs().max() <= TOL


def test_vocab_limit_cuts_the_logits_columns(family_dir: Path) -> None:
    path = family_dir / "draft-structured"
    full = ModelRunner(path, max_seqs=1, kv_cache_bytes=SMALL)
    cut = ModelRunner(path, max_seqs=2, kv_cache_bytes=SMALL, vocab_limit=1000)
    wide = ModelRunner(path, max_seqs=1, kv_cache_bytes=SMALL, vocab_limit=10**6)
    assert (cut.vocab_limit, cut.vocab_size) == (1000, 4096)
    assert (wide.vocab_limit, full.vocab_limit) == (4096, 4096)
    ids = (5, 17, 300, 42, 9)
    out = [r.forward([ForwardItem(r.cache.blocks.admit("a"), ids)]) for r in (full, cut, wide)]
    assert out[0].shape == (1, 5, 4096) and out[1].shape == (1, 5, 1000)
    assert torch.allclose(out[1], out[0][..., :1000], atol=1e-5, rtol=0)
    assert torch.equal(out[2], out[0])
    last = cut.forward([ForwardItem(cut.cache.blocks.admit("b"), ids)], last_only=True)
    assert last.shape == (1, 1, 1000)
    assert torch.allclose(last[0, 0], out[1][0, -1], atol=1e-5, rtol=0)


def test_a_forward_without_blocks_raises_cache_full_and_takes_none(family_dir: Path) -> None:
    path = family_dir / "draft-structured"
    per_block = 2 * 1 * 2 * 64 * 4 * 16  # layers, kv heads, head dim, fp32, block size
    runner = ModelRunner(path, max_seqs=2, max_model_len=64, kv_cache_bytes=4 * per_block)
    blocks = runner.cache.blocks
    assert blocks.num_blocks == 4 and runner.cache.nbytes == 4 * per_block
    a, b = blocks.admit("a"), blocks.admit("b")
    runner.forward([ForwardItem(a, tuple(range(1, 41)))])  # 3 blocks
    runner.cache.commit(a, 40)
    with pytest.raises(CacheFull, match="needs 2 more KV blocks, 1 are free"):
        runner.forward([ForwardItem(b, tuple(range(1, 21)))])
    with pytest.raises(CacheFull):  # a whole batch: neither item takes a block
        runner.forward([ForwardItem(a, tuple(range(9))), ForwardItem(b, tuple(range(9)))])
    assert blocks.free_blocks == 1 and blocks.tables[b] == [] and len(blocks.tables[a]) == 3
    assert runner.forward([ForwardItem(b, tuple(range(1, 17)))]).shape[1] == 16  # one fits


def test_runner_config_sizes_the_cache(family_dir: Path) -> None:
    path = family_dir / "draft-structured"
    per_token = 2 * 1 * 2 * 64 * 4  # layers, kv heads, head dim, fp32
    runner = RunnerConfig(device="cpu", kv_cache_memory=10 * 8 * per_token, max_model_len=64,
                          max_seqs=3, block_size=8).load(path, vocab_limit=100)
    blocks = runner.cache.blocks
    assert (blocks.num_blocks, blocks.block_size, blocks.max_seqs) == (10, 8, 3)
    assert runner.max_len == 64 and runner.vocab_limit == 100
    assert runner.dtype == torch.float32 and runner.device.type == "cpu"
    assert runner.weight_bytes > 0 and "10 blocks of 8 tokens" in describe(runner)
    bf16 = ModelRunner(path, max_seqs=1, dtype="bfloat16", kv_cache_bytes=SMALL)
    assert bf16.cache.k.dtype == torch.bfloat16 and bf16.cache.blocks.num_blocks == 2048
    logits = bf16.forward([ForwardItem(bf16.cache.blocks.admit("a"), (5, 17, 300))])
    assert bool(logits.float().isfinite().all())
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        ModelRunner(path, max_model_len=81, kv_cache_bytes=10 * 8 * per_token, block_size=8)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        ModelRunner(path, max_model_len=2048, kv_cache_bytes=SMALL)


def test_context_overflow_is_refused(family_dir: Path) -> None:
    runner = ModelRunner(family_dir / "draft-structured", max_seqs=1, max_model_len=16,
                         kv_cache_bytes=SMALL)
    seq = runner.cache.blocks.admit("a")
    with pytest.raises(ValueError, match="exceed 16"):
        runner.forward([ForwardItem(seq, tuple(range(17)))])


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    from transformers import GPT2Config
    AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
                                     ).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not supported"):
        ModelRunner(tmp_path)
