"""Draft models inside the verifier: output with their drafts equals the target alone (greedy,
token for token) and follows the target's distribution (sampled, chi-square); the draft is the
drafter's own; a drafter of another vocabulary is refused."""

from __future__ import annotations

import pytest
import torch
from chi_square import chi_square_p
from real_sizes import make_pair
from transformers import AutoModelForCausalLM, LlamaConfig

from spin.engine.colocated import load_colocated
from spin.engine.drafter import DraftRequest, ModelDrafter
from spin.engine.head_runner import HeadAsk
from spin.engine.model_runner import RunnerConfig
from spin.engine.sampling import SamplingParams
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


def _generate(v: Verifier, prompts: list[list[int]], n: int, colocated: bool,
              sampling: SamplingParams = SamplingParams()) -> tuple[list[list[int]], int]:
    """Each prompt's first ``n`` tokens, every step verifying the drafter's last chain (k from
    1 to 4 by request, none every fifth step); the drafted tokens accepted."""
    out: list[list[int]] = [[] for _ in prompts]
    drafts: dict[int, tuple[int, ...]] = {}
    accepted, step = 0, 0
    while any(len(o) < n for o in out):
        reqs, idx = [], []
        for i, p in enumerate(prompts):
            if len(out[i]) >= n:
                continue
            d = drafts.get(i, ())
            keep = len(p) + len(out[i]) if out[i] else 0
            k = 0 if step % 5 == 4 else 1 + i % 4
            reqs.append(VerifyRequest(f"r{i}", [] if keep else p, TokenTree.chain(list(d)),
                                      sampling, keep=keep,
                                      head=HeadAsk("d", k=k, stored=len(d))
                                      if colocated else None))
            idx.append(i)
        for i, verdict in zip(idx, v.verify(reqs)):
            out[i] += list(verdict.tokens)
            drafts[i] = verdict.head_draft
            accepted += verdict.num_accepted
        step += 1
    return [o[:n] for o in out], accepted


@pytest.mark.parametrize("batch", [1, 4, 16])
@pytest.mark.parametrize("drafter_seed", [0, 7])  # the target's own weights, then another model
def test_greedy_output_with_a_colocated_drafter_equals_the_target_alone(
        batch: int, drafter_seed: int) -> None:
    target = _tiny(0)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 300, (int(torch.randint(3, 40, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(batch)]
    with_drafter = _verifier(target, _tiny(drafter_seed))
    alone, _ = _generate(_verifier(target), prompts, 24, False)
    out, accepted = _generate(with_drafter, prompts, 24, True)
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
    sp, prompt = SamplingParams(temperature=1.0), [1, 2, 3]
    counts = torch.zeros(8, 8)
    drafted = accepted = 0
    for batch in range(48):
        ids = [f"b{batch}-{i}" for i in range(64)]
        first = v.verify([VerifyRequest(rid, prompt, EMPTY, sp, head=HeadAsk("d", k=2))
                          for rid in ids])
        second = v.verify([VerifyRequest(rid, [], TokenTree.chain(list(f.head_draft)), sp,
                                         keep=4, head=HeadAsk("d", stored=len(f.head_draft)))
                           for rid, f in zip(ids, first)])
        for f, s in zip(first, second):
            counts[f.tokens[0], s.tokens[0]] += 1
            drafted += len(f.head_draft)
            accepted += s.num_accepted
        for rid in ids:
            v.release(rid)
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt])).logits[0, -1], -1)            # [V]
        p2 = torch.softmax(target(torch.tensor([prompt + [a] for a in range(8)])).logits[:, -1],
                           -1)                                                          # [V, V]
    assert 0 < accepted < drafted  # drafts both accepted and rejected
    assert counts[:, 6:].sum() > 0  # tokens the drafter never drafts are emitted too
    assert chi_square_p(counts.flatten(), (p1[:, None] * p2).flatten()) > 0.01


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
