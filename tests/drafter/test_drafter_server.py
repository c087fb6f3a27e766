"""DrafterService.run_batch, driven with spin.v1 messages directly (no network).

Named test_drafter_server.py, not test_server.py: the test dirs have no __init__.py, so two
test_server.py modules (drafter and verifier) would clash at collection.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from spin.drafter.server import DrafterService
from spin.engine.drafter import DraftRequest, ModelDrafter
from spin.engine.model_runner import ModelRunner, RunnerConfig
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.rpc.convert import sampling_to_proto, tree_from_proto
from spin.v1 import drafter_pb2, sampling_pb2
from spin.zoo.corpus import heldout_prompts
from spin.zoo.specs import FAMILY_DIR

PATH = FAMILY_DIR / "draft-code"
SLOTS = 4
KV = 8 << 20  # KV cache budget of each runner here (170 blocks of 16 tokens)
BLOCK = 2 * 2 * 3 * 64 * 4 * 16  # one KV block of draft-code in fp32


def _config(max_seqs: int = SLOTS, **kw) -> RunnerConfig:
    return RunnerConfig(device="cpu", max_seqs=max_seqs, kv_cache_memory=kw.pop("kv", KV), **kw)


@pytest.fixture(scope="module")
def service() -> DrafterService:
    """Without prefix caching: these tests send the same contexts again and count what is
    computed (``test_a_cached_prefix_is_not_computed_or_scored_again`` has it on)."""
    return DrafterService("draft-code", PATH, _config(prefix_caching=False))


@pytest.fixture(scope="module")
def reference() -> ModelDrafter:
    """The engine's drafter on the same checkpoint, in its own runner."""
    return ModelDrafter("ref", ModelRunner(PATH, max_seqs=SLOTS, kv_cache_bytes=KV,
                                           prefix_caching=False))


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    """Held-out code prompts of different lengths, tokenized by the demo tokenizer."""
    tok = AutoTokenizer.from_pretrained(FAMILY_DIR / "target")
    rows = heldout_prompts(FAMILY_DIR, ("code",))[:6]
    return [tuple(tok.encode(r["prompt"], add_special_tokens=False)[-n:])
            for r, n in zip(rows, (40, 25, 33, 17, 48, 29))]


@pytest.fixture(autouse=True)
def clean(service: DrafterService) -> Iterator[None]:
    """Every test starts and ends with an empty service (all requests released)."""
    yield
    seqs = service.drafter.seqs
    service.run_batch(drafter_pb2.SpeculateRequest(release=[s.request_id for s in seqs]))
    blocks = service.drafter.runner.cache.blocks
    assert blocks.free_seqs == SLOTS and len(seqs) == 0
    assert blocks.free_blocks == blocks.num_blocks


def _task(rid: str, keep: int, delta, k: int = 4, branching=(),
          sampling: SamplingParams = SamplingParams()) -> drafter_pb2.DraftTask:
    return drafter_pb2.DraftTask(request_id=rid, keep=keep, context_delta=list(delta), k=k,
                                 branching=list(branching), sampling=sampling_to_proto(sampling))


def _batch(*tasks: drafter_pb2.DraftTask, batch_id: int = 1, release=()) -> drafter_pb2.SpeculateRequest:
    return drafter_pb2.SpeculateRequest(batch_id=batch_id, tasks=list(tasks), release=list(release))


def _ref(reference: ModelDrafter, ctx, k: int = 4, branching=(),
         sampling: SamplingParams = SamplingParams()) -> TokenTree:
    """What the engine's drafter proposes for ``ctx`` from scratch."""
    tree = reference.propose([DraftRequest("ref", tuple(ctx), k, tuple(branching), sampling)])[0]
    reference.release("ref")
    return tree


def test_info_reports_the_model_and_its_cache(service) -> None:
    info = service.info()
    assert (info.name, info.model_path, info.vocab_size) == ("draft-code", str(PATH), 4096)
    assert (info.max_requests, info.block_size, info.num_blocks) == (SLOTS, 16, KV // BLOCK)
    assert info.kv_cache_bytes == info.num_blocks * BLOCK and info.weight_bytes > 0
    assert (info.device, info.dtype, info.tokenizer_size) == ("cpu", "float32", 4096)
    assert service.drafter.runner.vocab_limit == 4096  # the tokenizer's ids


def test_new_request_gets_the_engines_greedy_chain(service, reference, prompts) -> None:
    ctx = prompts[0]
    resp = service.run_batch(_batch(_task("a", 0, ctx, k=4), batch_id=2**40 + 7))
    assert resp.batch_id == 2**40 + 7 and resp.draft_seconds > 0
    assert len(resp.results) == 1
    res = resp.results[0]
    assert res.request_id == "a" and not res.resync
    want = _ref(reference, ctx, 4)
    assert len(want) == 4
    assert tuple(res.tree.tokens) == want.tokens
    assert tuple(res.tree.parents) == (-1, 0, 1, 2)
    assert len(res.tree.probs) == 0  # greedy drafts are one-hot: no distributions on the wire
    blocks = service.drafter.runner.cache.blocks
    assert blocks.free_seqs == SLOTS - 1
    assert resp.num_blocks == blocks.num_blocks == KV // BLOCK
    assert resp.free_blocks == blocks.free_blocks == blocks.num_blocks - 3  # 40 + 3 drafted


def test_follow_up_with_delta_equals_drafting_from_scratch(service, reference, prompts) -> None:
    ctx = prompts[1]
    first = service.run_batch(_batch(_task("a", 0, ctx, k=3))).results[0]
    drafted = list(first.tree.tokens)
    # the verifier accepted the first drafted token and corrected the second
    delta = [drafted[0], (drafted[1] + 1) % 4096]
    res = service.run_batch(_batch(_task("a", len(ctx), delta, k=4), batch_id=2)).results[0]
    assert not res.resync
    assert tuple(res.tree.tokens) == _ref(reference, ctx + tuple(delta), 4).tokens
    # and once more, everything accepted
    full = ctx + tuple(delta)
    delta2 = list(res.tree.tokens[:2])
    res = service.run_batch(_batch(_task("a", len(full), delta2, k=2), batch_id=3)).results[0]
    assert tuple(res.tree.tokens) == _ref(reference, full + tuple(delta2), 2).tokens


def test_keep_shorter_than_held_truncates(service, reference, prompts) -> None:
    ctx = prompts[2]
    service.run_batch(_batch(_task("a", 0, ctx, k=4)))
    delta = [11, 12]
    res = service.run_batch(_batch(_task("a", len(ctx) - 5, delta, k=3))).results[0]
    assert not res.resync
    assert tuple(res.tree.tokens) == _ref(reference, ctx[:-5] + tuple(delta), 3).tokens


def test_keep_beyond_held_is_resync(service, reference, prompts) -> None:
    ctx = prompts[0]
    service.run_batch(_batch(_task("a", 0, ctx, k=2)))
    res = service.run_batch(_batch(_task("a", len(ctx) + 1, [5], k=2))).results[0]
    assert res.resync and res.request_id == "a"
    assert len(res.tree.tokens) == 0 and len(res.tree.parents) == 0
    # the router resyncs with the whole context: drafting works again
    res = service.run_batch(_batch(_task("a", 0, ctx + (5,), k=2))).results[0]
    assert not res.resync and tuple(res.tree.tokens) == _ref(reference, ctx + (5,), 2).tokens


def test_unknown_request_with_keep_is_resync(service, prompts) -> None:
    resp = service.run_batch(_batch(_task("ghost", 3, [1, 2], k=2), _task("b", 0, prompts[3], k=2)))
    ghost, b = resp.results
    assert ghost.request_id == "ghost" and ghost.resync and len(ghost.tree.tokens) == 0
    assert b.request_id == "b" and not b.resync and len(b.tree.tokens) == 2
    assert "ghost" not in service.drafter.seqs and service.drafter.held("ghost") == 0
    assert service.drafter.runner.cache.blocks.free_seqs == SLOTS - 1


def test_release_frees_the_sequence_and_its_blocks(service, prompts) -> None:
    blocks = service.drafter.runner.cache.blocks
    service.run_batch(_batch(_task("a", 0, prompts[0], k=2), _task("b", 0, prompts[1], k=2)))
    assert blocks.free_seqs == SLOTS - 2
    held_b = blocks.num_blocks - blocks.free_blocks - 3  # a: 40 + 1 drafted tokens, 3 blocks
    resp = service.run_batch(_batch(release=["a", "never-seen"], batch_id=9))
    assert resp.batch_id == 9 and len(resp.results) == 0
    assert blocks.free_seqs == SLOTS - 1 and blocks.free_blocks == blocks.num_blocks - held_b
    assert resp.free_blocks == blocks.free_blocks
    assert "a" not in service.drafter.seqs and "b" in service.drafter.seqs
    res = service.run_batch(_batch(_task("a", len(prompts[0]), [], k=2))).results[0]
    assert res.resync  # its context is gone with its sequence


def test_more_new_requests_than_sequences(service, reference, prompts) -> None:
    """The extra requests get no draft this step and a resync (the drafter could not hold
    their context); the others draft."""
    blocks = service.drafter.runner.cache.blocks
    tasks = [_task(f"r{i}", 0, p, k=3) for i, p in enumerate(prompts)]  # 6 > 4 sequences
    resp = service.run_batch(_batch(*tasks))
    assert [r.request_id for r in resp.results] == [f"r{i}" for i in range(6)]
    assert [len(r.tree.tokens) for r in resp.results] == [3, 3, 3, 3, 0, 0]
    assert [r.resync for r in resp.results] == [False] * 4 + [True] * 2
    assert blocks.free_seqs == 0
    for i in range(4):
        assert tuple(resp.results[i].tree.tokens) == _ref(reference, prompts[i], 3).tokens


def test_extra_requests_resync_then_draft(service, reference, prompts) -> None:
    """Requests past --max-seqs are answered resync (the drafter cannot hold their context);
    sent whole again once sequences free up, they draft as any other."""
    blocks = service.drafter.runner.cache.blocks
    first = service.run_batch(_batch(*[_task(f"r{i}", 0, p, k=3) for i, p in enumerate(prompts)]))
    held = blocks.max_seqs
    assert [r.resync for r in first.results] == [i >= held for i in range(len(prompts))]
    resp = service.run_batch(_batch(_task("r4", 0, prompts[4], k=3),
                                    _task("r5", 0, prompts[5], k=3), release=["r0", "r1"]))
    assert not any(r.resync for r in resp.results)
    assert tuple(resp.results[0].tree.tokens) == _ref(reference, prompts[4], 3).tokens
    assert tuple(resp.results[1].tree.tokens) == _ref(reference, prompts[5], 3).tokens
    assert blocks.free_seqs == 0


def test_branching_tree(service, reference, prompts) -> None:
    ctx = prompts[0]
    tree = service.run_batch(_batch(_task("a", 0, ctx, k=2, branching=(2, 1)))).results[0].tree
    assert len(tree.tokens) == 4
    assert tuple(tree.parents) == (-1, -1, 0, 1)
    assert len(tree.probs) == 0
    want = _ref(reference, ctx, 2, (2, 1))
    assert tuple(tree.tokens) == want.tokens
    assert tree.tokens[0] == _ref(reference, ctx, 1).tokens[0]  # first branch = greedy token
    assert tree.tokens[0] != tree.tokens[1]


def test_sampling_returns_probability_rows(service, reference, prompts) -> None:
    ctx = prompts[1]
    sampling = SamplingParams(temperature=0.8, top_k=5, seed=11)
    tree = service.run_batch(_batch(_task("a", 0, ctx, k=3, branching=(2,), sampling=sampling))
                             ).results[0].tree
    assert len(tree.tokens) == 6 and tuple(tree.parents) == (-1, -1, 0, 1, 2, 3)  # two chains of 3
    assert len(tree.probs) == len(tree.tokens)
    for tok, row in zip(tree.tokens, tree.probs):
        assert len(row.dense_f16) == 0 and 1 <= len(row.token_ids) <= 5  # top-5 rows ship sparse
        assert tok in row.token_ids and len(row.token_probs_f16) == 2 * len(row.token_ids)
        values = np.frombuffer(row.token_probs_f16, dtype="<f2").astype(np.float32)
        assert float(values.sum()) == pytest.approx(1.0, abs=3e-3)  # fp16 rounding
    # seeded: the engine's drafter draws the same tokens with the same distributions, which
    # come through the wire bit for bit
    want = _ref(reference, ctx, 3, (2,), sampling)
    assert tuple(tree.tokens) == want.tokens
    back = tree_from_proto(tree, want.draft_probs.shape[1])
    assert back.draft_probs.dtype == want.draft_probs.dtype == torch.float16
    assert torch.equal(back.draft_probs.view(torch.int16), want.draft_probs.view(torch.int16))


def test_nothing_to_draft_gives_empty_trees(service, prompts) -> None:
    """k=0, an empty context, a zero branching or bad sampling: empty tree, no resync, no
    block (a k=0 task only updates the context)."""
    bad = _task("bad", 0, prompts[0], k=2)
    bad.sampling.CopyFrom(sampling_pb2.SamplingParams(temperature=1.0, top_p=1.5))
    resp = service.run_batch(_batch(_task("k0", 0, prompts[0], k=0),
                                    _task("empty", 0, [], k=3),
                                    _task("zero-branch", 0, prompts[1], k=2, branching=(0,)),
                                    bad))
    assert [r.request_id for r in resp.results] == ["k0", "empty", "zero-branch", "bad"]
    assert all(len(r.tree.tokens) == 0 and not r.resync for r in resp.results)
    blocks = service.drafter.runner.cache.blocks
    assert blocks.free_blocks == blocks.num_blocks
    assert [service.drafter.held(r) for r in ("k0", "empty", "zero-branch", "bad")] == \
        [len(prompts[0]), 0, 0, 0]


def test_k_clipped_to_the_context_limit(prompts) -> None:
    small = DrafterService("tiny", PATH, _config(1, max_model_len=32))
    ctx = prompts[0][:29]
    res = small.run_batch(_batch(_task("a", 0, ctx, k=6))).results[0]
    assert len(res.tree.tokens) == 3  # 32 - 29
    res = small.run_batch(_batch(_task("a", 0, prompts[0][:32], k=6))).results[0]
    assert len(res.tree.tokens) == 0 and not res.resync


def test_branching_tree_near_the_context_limit_fits(prompts) -> None:
    small = DrafterService("tiny-tree", PATH, _config(2, max_model_len=32))
    ctx = tuple(range(100, 128))  # 28 tokens
    resp = small.run_batch(_batch(_task("ok", 0, prompts[3][:10], k=2),
                                  _task("tight", 0, ctx, k=3, branching=(4, 4))))
    ok, tight = resp.results
    assert len(ok.tree.tokens) == 2 and not tight.resync
    assert len(ctx) + len(tight.tree.tokens) <= 32


def test_score_task_reports_agreement_and_drafts_nothing(service, reference, prompts) -> None:
    ctx = prompts[0]
    task = _task("s", 0, ctx, k=0)
    task.score, task.score_from = True, 10
    (res,) = service.run_batch(_batch(task)).results
    assert not res.resync and len(res.tree.tokens) == 0
    assert res.score_positions == len(ctx) - 10
    assert (res.score_matches, res.score_positions) == tuple(
        reference.score([DraftRequest("ref-s", ctx, 0)], [10])[0][:2])
    assert res.score_acceptance_positions == 0  # greedy: no estimate
    reference.release("ref-s")
    # the prefill is kept: a follow-up draft needs only the delta
    (res,) = service.run_batch(_batch(_task("s", len(ctx), (), k=4), batch_id=2)).results
    assert tuple(res.tree.tokens) == _ref(reference, ctx).tokens


def test_a_cached_prefix_is_not_computed_or_scored_again(reference, prompts) -> None:
    """With prefix caching, a second request with the same context attaches the first one's
    full blocks: it scores only the positions after them, and drafts what a drafter without
    the cache drafts."""
    cached = DrafterService("cached", PATH, _config(prefix_caching=True))
    ctx = prompts[4]  # 48 tokens: two full blocks cached (the last token is always fed)
    for rid in ("a", "b"):
        task = _task(rid, 0, ctx, k=0)
        task.score, task.score_from = True, 10
        (res,) = cached.run_batch(_batch(task)).results
        # b: the positions after the first it is fed (whose predicting row is cached)
        assert res.score_positions == (len(ctx) - 10 if rid == "a" else len(ctx) - 32 - 1)
        cached.run_batch(drafter_pb2.SpeculateRequest(release=[rid]))
    (res,) = cached.run_batch(_batch(_task("c", 0, ctx, k=4))).results
    assert tuple(res.tree.tokens) == _ref(reference, ctx).tokens
    assert cached.drafter.runner.cache.blocks.prefix.hits == 2 * 32


def test_a_sampled_score_task_reports_the_acceptance_estimate(service, reference,
                                                             prompts) -> None:
    """With the target's probabilities of the context, a sampling request's score also reports
    the engine's acceptance estimate (``Score.accepted``) and the positions it covers."""
    ctx = prompts[0]
    sampling = SamplingParams(temperature=1.5, top_k=2000, seed=2)
    probs = [0.0] * 10 + [0.1 + 0.8 * (j % 5) / 4 for j in range(len(ctx) - 10)]
    task = _task("s", 0, ctx, k=0, sampling=sampling)
    task.score, task.score_from = True, 10
    task.context_probs.extend(probs)
    (res,) = service.run_batch(_batch(task)).results
    want = reference.score([DraftRequest("ref-s", ctx, 0, sampling=sampling,
                                         context_probs=probs)], [10])[0]
    reference.release("ref-s")
    assert res.score_acceptance_positions == want.accepted_positions == len(ctx) - 10
    assert res.score_acceptance == pytest.approx(want.accepted, rel=1e-5) and want.accepted > 0
    assert (res.score_matches, res.score_positions) == (want.matches, want.positions)


def test_stop_below_ends_the_chain_as_the_engine_does(service, reference, prompts) -> None:
    task = _task("s", 0, prompts[0], k=8)
    task.stop_below = 0.3
    got = service.run_batch(_batch(task)).results[0].tree
    want = reference.propose([DraftRequest("ref", prompts[0], 8, stop_below=0.3)])[0]
    reference.release("ref")
    assert list(got.tokens) == list(want.tokens) and len(want.tokens) < 8


def test_idle_caches_are_evicted_without_a_resync(reference, prompts) -> None:
    """Six blocks: drafting one request evicts the other's idle cache; the evicted request
    keeps its context (no resync) and drafts what a drafter that never evicted drafts."""
    small = DrafterService("tiny-kv", PATH, _config(kv=6 * BLOCK))
    a, b = prompts[4], prompts[2]  # 48 and 33 tokens: 4 and 3 blocks with their chains
    resp = small.run_batch(_batch(_task("a", 0, a, k=4)))
    assert (resp.num_blocks, resp.free_blocks) == (6, 2)
    resp = small.run_batch(_batch(_task("b", 0, b, k=4)))
    assert small.drafter.evictions == 1 and resp.free_blocks == 3
    assert tuple(resp.results[0].tree.tokens) == _ref(reference, b, 4).tokens
    res = small.run_batch(_batch(_task("a", len(a), (), k=4))).results[0]
    assert not res.resync and small.drafter.evictions == 2
    assert tuple(res.tree.tokens) == _ref(reference, a, 4).tokens
