"""Draft models inside the verifier: output with their drafts equals the target alone (greedy,
token for token) and follows the target's distribution (sampled, chi-square); the draft is the
drafter's own; a drafter of another vocabulary is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from chi_square import chi_square_p
from in_verifier import generate, joint, two_tokens
from real_sizes import make_pair
from transformers import AutoModelForCausalLM, LlamaConfig

from spin.engine.colocated import load_colocated
from spin.engine.drafter import DraftRequest, ModelDrafter
from spin.engine.head_runner import HeadAsk
from spin.engine.model_runner import RunnerConfig
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest

EMPTY = TokenTree((), ())
RUNNER = RunnerConfig(max_seqs=32, kv_cache_memory=16 << 20)


def _tiny(seed: int, vocab: int = 300, layers: int = 2) -> AutoModelForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()


def _verifier(target, drafter=None) -> Verifier:
    v = Verifier(RUNNER.load(target))
    if drafter is not None:
        v.add_colocated(ModelDrafter("d", RUNNER.load(drafter)))
    return v


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("drafter_seed", [0, 7])  # the target's own weights, then another model
def test_greedy_output_with_a_colocated_drafter_equals_the_target_alone(
        batch: int, drafter_seed: int) -> None:
    target = _tiny(0)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 300, (int(torch.randint(3, 40, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(batch)]
    with_drafter = _verifier(target, _tiny(drafter_seed))
    alone, _ = generate(_verifier(target), prompts, 24, None)
    out, accepted = generate(with_drafter, prompts, 24, "d", rest_every=5)
    assert out == alone
    if drafter_seed == 0:  # the same model: every drafted token is accepted
        assert accepted >= batch * 24 // 3
    assert with_drafter.heads["d"].drafts  # it drafted


def test_the_draft_is_the_drafters_own_chain() -> None:
    target, draft = _tiny(0), _tiny(3)
    v = _verifier(target, draft)
    prompt = list(range(40, 60))
    (verdict,) = v.verify([VerifyRequest("r", prompt, EMPTY, head=HeadAsk("d", k=4))])
    own = ModelDrafter("own", RUNNER.load(draft))
    (tree,) = own.propose([DraftRequest("r", prompt + list(verdict.tokens), 4)])
    assert verdict.head_draft == tree.tokens and len(tree.tokens) == 4
    v.release("r")
    assert "r" not in v.heads["d"].drafter.seqs and not v.heads["d"].drafts


def test_sampled_output_with_colocated_drafts_follows_the_target() -> None:
    """The first two tokens after a prompt, the second verified against the drafter's sampled
    draft (drafting over 6 of the 8 tokens), follow the target's joint distribution."""
    target, draft = _tiny(5, vocab=8, layers=4), _tiny(6, vocab=8)
    v = Verifier(RunnerConfig(max_seqs=64, kv_cache_memory=16 << 20).load(target))
    v.add_colocated(ModelDrafter("d", RunnerConfig(max_seqs=64, kv_cache_memory=16 << 20)
                                 .load(draft, vocab_limit=6)))
    counts, drafted, accepted = two_tokens(v, "d", [1, 2, 3], 8)
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert counts[:, 6:].sum() > 0  # tokens the drafter never drafts are emitted too
    assert chi_square_p(counts.flatten(), joint(target, [1, 2, 3], 8)) > 0.01


def test_a_drafter_of_another_vocabulary_is_refused(tmp_path_factory) -> None:
    # Qwen2.5's 7B and 0.5B pad one tokenizer to different rows: without the tokenizer saved
    # beside them nothing shows they share it
    target_dir, draft_dir = make_pair("qwen2", tmp_path_factory.getbasetemp() / "colocated")
    target = RunnerConfig(max_seqs=4, kv_cache_memory=8 << 20, dtype="float32").load(target_dir)
    with pytest.raises(ValueError, match="colocated drafter d .* vocabulary rows"):
        load_colocated("d", draft_dir, target, None, RunnerConfig(dtype="float32"))
    fits = load_colocated("t", target_dir, target, None, RunnerConfig(dtype="float32"))
    blocks = fits.runner.cache.blocks
    assert blocks.num_blocks * blocks.block_size == (target.cache.blocks.num_blocks
                                                     * target.cache.blocks.block_size)


def test_two_drafters_of_one_name_are_refused() -> None:
    v = _verifier(_tiny(0), _tiny(1))
    with pytest.raises(ValueError, match="already serves a drafter named d"):
        v.add_colocated(ModelDrafter("d", RUNNER.load(_tiny(2))))


@pytest.mark.parametrize("device,dtype", [
    pytest.param("cpu", "float32", id="cpu-float32"),
    pytest.param("cuda", "float32", id="cuda-float32", marks=pytest.mark.cuda),
    pytest.param("cuda", "bfloat16", id="cuda-bfloat16", marks=pytest.mark.cuda)])
def test_the_demo_code_drafter_inside_the_verifier_on_each_device(family_dir: Path, device: str,
                                                                  dtype: str) -> None:
    """The demo target with draft-code loaded beside it (``load_colocated``: its KV cache sized
    to the target's, on the target's device; CUDA: ``scripts/gpu-check``), batches of 1 and 8:
    greedy output equals the verifier alone (float32: token for token) and drafts are
    accepted."""
    cfg = RunnerConfig(device=device, dtype=dtype, max_seqs=16, kv_cache_memory=64 << 20)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 2000, (24,), generator=g).tolist() for _ in range(8)]
    alone = Verifier(cfg.load(family_dir / "target"))
    for batch in (prompts[:1], prompts):
        target = cfg.load(family_dir / "target")
        with_drafter = Verifier(target)
        with_drafter.add_colocated(load_colocated("d", family_dir / "draft-code", target, None,
                                                  cfg))
        got, accepted = generate(with_drafter, batch, 16, "d")
        if dtype == "float32":
            assert got == generate(alone, batch, 16, None)[0]
        assert all(len(o) == 16 for o in got) and accepted > 0

