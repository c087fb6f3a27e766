"""VerifierService.run_batch, driven with spin.v1 messages directly (no network).

Named test_verifier_server.py, not test_server.py: the test dirs have no __init__.py, so two
test_server.py modules (drafter and verifier) would clash at collection.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from spin.drafter.server import DrafterService
from spin.engine.drafter import ModelDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ModelRunner, RunnerConfig
from spin.engine.sampling import SamplingParams, probs_from_logits
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier
from spin.rpc.convert import sampling_to_proto, tree_to_proto
from spin.v1 import drafter_pb2, sampling_pb2, token_tree_pb2, verifier_pb2
from spin.verifier.server import BatchRejected, VerifierService
from spin.zoo.corpus import heldout_prompts
from spin.zoo.specs import FAMILY_DIR

PATH = FAMILY_DIR / "target"
DRAFT = FAMILY_DIR / "draft-code"
SLOTS = 4
NEW = 12
VOCAB = 4096
KV = 32 << 20  # the target's KV cache budget here (85 blocks of 16 tokens)
TBLOCK = 2 * 8 * 6 * 64 * 4 * 16  # one KV block of the demo target in fp32


def _config(max_seqs: int = SLOTS, kv: int = KV, **kw) -> RunnerConfig:
    return RunnerConfig(device="cpu", max_seqs=max_seqs, kv_cache_memory=kv, **kw)


@pytest.fixture(scope="module")
def service() -> VerifierService:
    return VerifierService(PATH, _config())


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    """Held-out code prompts of different lengths, tokenized by the demo tokenizer."""
    tok = AutoTokenizer.from_pretrained(PATH)
    rows = heldout_prompts(FAMILY_DIR, ("code",))[:3]
    return [tuple(tok.encode(r["prompt"], add_special_tokens=False)[-n:])
            for r, n in zip(rows, (30, 21, 37))]


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    """The in-process engine (the reference): target alone, or with draft-code."""
    return SpecEngine(Verifier(ModelRunner(PATH, max_seqs=2, kv_cache_bytes=KV)),
                      {"draft-code": ModelDrafter("draft-code", ModelRunner(
                          DRAFT, max_seqs=2, kv_cache_bytes=8 << 20))})


@pytest.fixture(scope="module")
def greedy(engine: SpecEngine, prompts) -> list[list[int]]:
    """Target-alone greedy continuation of each prompt (NEW + 1 tokens)."""
    return [engine.generate([GenerationRequest(f"g{i}", p, NEW + 1)])[0].tokens
            for i, p in enumerate(prompts)]


@pytest.fixture(autouse=True)
def clean(service: VerifierService) -> Iterator[None]:
    """Every test ends with an empty service (all requests released)."""
    yield
    seqs = service.verifier.seqs
    service.run_batch(verifier_pb2.VerifyRequest(release=[s.request_id for s in seqs]))
    blocks = service.verifier.runner.cache.blocks
    assert blocks.free_seqs == SLOTS and len(seqs) == 0
    assert blocks.free_blocks == blocks.num_blocks


def _task(rid: str, keep: int, delta=(), tree: TokenTree | token_tree_pb2.TokenTree | None = None,
          sampling: SamplingParams = SamplingParams()) -> verifier_pb2.VerifyTask:
    msg = tree if isinstance(tree, token_tree_pb2.TokenTree) else tree_to_proto(tree or TokenTree((), ()))
    return verifier_pb2.VerifyTask(request_id=rid, keep=keep, context_delta=list(delta), tree=msg,
                                   sampling=sampling_to_proto(sampling))


def _batch(*tasks: verifier_pb2.VerifyTask, batch_id: int = 1, release=()) -> verifier_pb2.VerifyRequest:
    return verifier_pb2.VerifyRequest(batch_id=batch_id, tasks=list(tasks), release=list(release))


def _decode_plain(service: VerifierService, prompts, steps: int,
                  sampling: SamplingParams = SamplingParams()) -> list[list[int]]:
    """Plain steps (empty trees) for all prompts in one batch; after the first step only
    keep=len(context) and no delta (the verifier extends its own context)."""
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(steps):
        tasks = [_task(f"p{i}", 0, p, sampling=sampling) if step == 0 else
                 _task(f"p{i}", len(p) + len(out[i]), sampling=sampling)
                 for i, p in enumerate(prompts)]
        resp = service.run_batch(_batch(*tasks, batch_id=100 + step))
        assert resp.batch_id == 100 + step
        for i, res in enumerate(resp.results):
            assert res.request_id == f"p{i}" and not res.resync and not res.preempted
            assert len(res.tokens) == 1 and res.num_accepted == 0
            out[i].extend(res.tokens)
    return out


def test_info_reports_the_model_and_its_cache(service) -> None:
    info = service.info()
    runner = service.verifier.runner
    assert (info.name, info.model_path, info.vocab_size) == ("target", str(PATH), VOCAB)
    assert (info.max_context, info.max_requests) == (runner.max_len, SLOTS) == (1024, SLOTS)
    assert (info.block_size, info.num_blocks) == (16, KV // TBLOCK)
    assert info.kv_cache_bytes == info.num_blocks * TBLOCK and info.weight_bytes > 0
    assert (info.device, info.dtype) == ("cpu", "float32")
    assert info.tokenizer_size == VOCAB and len(info.tokenizer_fingerprint) == 64
    assert info.tokenizer.endswith("target")


def test_plain_greedy_steps_equal_target_alone(service, prompts, greedy) -> None:
    got = _decode_plain(service, prompts, NEW)
    assert got == [g[:NEW] for g in greedy]
    blocks = service.verifier.runner.cache.blocks
    assert blocks.free_seqs == SLOTS - len(prompts)
    # each cache holds its context but the last token: prompt + NEW - 1 tokens
    held = sum(blocks.blocks_for(len(p) + NEW - 1) for p in prompts)
    assert blocks.free_blocks == blocks.num_blocks - held


def test_seeded_sampling_steps_equal_the_engine(service, engine, prompts) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=1234)
    got = _decode_plain(service, prompts[:1], 8, sampling)[0]
    want = engine.generate([GenerationRequest("s", prompts[0], 8, sampling)])[0].tokens
    assert got == want


@torch.inference_mode()
def test_sampled_results_carry_each_token_s_target_probability(service, target, prompts,
                                                                greedy) -> None:
    """A sampling task's result gives each emitted token's probability under the processed
    target row it came from (what a scoring drafter estimates acceptance against); a greedy
    task's gives none."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    chain = TokenTree.chain(greedy[1][:3])  # the target's own argmax: likely accepted
    res_g, res_s = service.run_batch(_batch(_task("g", 0, prompts[0]),
                                            _task("s", 0, prompts[1], chain, sampling))).results
    assert list(res_g.token_probs) == []
    ctx = list(prompts[1]) + list(res_s.tokens)
    rows = probs_from_logits(target(input_ids=torch.tensor([ctx])).logits[0], sampling)
    first = len(prompts[1]) - 1  # the row after the prompt predicts the first emitted token
    want = [float(rows[first + j, x]) for j, x in enumerate(res_s.tokens)]
    assert len(res_s.token_probs) == len(res_s.tokens) and res_s.num_accepted >= 1
    assert list(res_s.token_probs) == pytest.approx(want, abs=1e-4)
    assert all(0 < p <= 1 for p in res_s.token_probs)


def test_tree_with_greedy_first_token_is_accepted(service, prompts, greedy) -> None:
    p, g = prompts[0], greedy[0]
    wrong = (g[2] + 1) % VOCAB
    resp = service.run_batch(_batch(_task("a", 0, p, TokenTree.chain([g[0], g[1], wrong]))))
    res = resp.results[0]
    assert res.num_accepted == 2 and list(res.tokens) == g[:3]
    # the verifier appended what it emitted: the next step continues after it
    res = service.run_batch(_batch(_task("a", len(p) + 3, (), TokenTree.chain(g[3:7])))).results[0]
    assert res.num_accepted == 4 and list(res.tokens) == g[3:8]
    res = service.run_batch(_batch(_task("a", len(p) + 8))).results[0]
    assert list(res.tokens) == [g[8]] and res.num_accepted == 0


def test_branching_tree_accepts_the_right_branch(service, prompts, greedy) -> None:
    """The accepted path is the second branch; its cache entries are compacted into place."""
    p, g = prompts[1], greedy[1]
    wrong = (g[0] + 7) % VOCAB
    tree = TokenTree((wrong, g[0], wrong, g[1]), (-1, -1, 0, 1))
    res = service.run_batch(_batch(_task("a", 0, p, tree))).results[0]
    assert res.num_accepted == 2 and list(res.tokens) == g[:3]
    out = list(res.tokens)
    for _ in range(3):
        res = service.run_batch(_batch(_task("a", len(p) + len(out)))).results[0]
        out.extend(res.tokens)
    assert out == g[:6]


def test_wrong_first_token_is_corrected(service, prompts, greedy) -> None:
    p, g = prompts[2], greedy[2]
    res = service.run_batch(_batch(_task("a", 0, p, TokenTree.chain([(g[0] + 1) % VOCAB, g[1]])))
                            ).results[0]
    assert res.num_accepted == 0 and list(res.tokens) == [g[0]]


def test_delta_after_keep(service, prompts, greedy) -> None:
    """The router may also send emitted tokens as a delta (keep = what it sent before)."""
    p, g = prompts[0], greedy[0]
    service.run_batch(_batch(_task("a", 0, p[:10])))
    res = service.run_batch(_batch(_task("a", 10, p[10:] + tuple(g[:2])))).results[0]
    assert list(res.tokens) == [g[2]]


def test_keep_beyond_held_is_resync(service, prompts) -> None:
    p = prompts[0]
    service.run_batch(_batch(_task("a", 0, p)))
    res = service.run_batch(_batch(_task("a", len(p) + 2))).results[0]  # holds len(p) + 1
    assert res.resync and len(res.tokens) == 0 and res.num_accepted == 0
    res = service.run_batch(_batch(_task("a", len(p) + 1))).results[0]
    assert not res.resync and len(res.tokens) == 1


def test_unknown_request_and_empty_context_are_resync(service, prompts) -> None:
    resp = service.run_batch(_batch(_task("ghost", 5), _task("empty", 0, ()), _task("b", 0, prompts[0])))
    ghost, empty, b = resp.results
    assert ghost.resync and empty.resync and not b.resync
    assert len(ghost.tokens) == 0 and len(empty.tokens) == 0 and len(b.tokens) == 1
    assert "ghost" not in service.verifier.seqs and "empty" not in service.verifier.seqs
    assert service.verifier.runner.cache.blocks.free_seqs == SLOTS - 1


def test_release_frees_the_sequence_and_its_blocks(service, prompts) -> None:
    blocks = service.verifier.runner.cache.blocks
    resp = service.run_batch(_batch(_task("a", 0, prompts[0]), _task("b", 0, prompts[1])))
    assert blocks.free_seqs == SLOTS - 2
    assert (resp.free_blocks, resp.num_blocks) == (blocks.num_blocks - 2 - 2, KV // TBLOCK)
    resp = service.run_batch(_batch(release=["a", "never-seen"], batch_id=5))
    assert resp.batch_id == 5 and len(resp.results) == 0
    assert resp.free_blocks == blocks.free_blocks == blocks.num_blocks - 2
    seqs = service.verifier.seqs
    assert blocks.free_seqs == SLOTS - 1 and "a" not in seqs and "b" in seqs
    res = service.run_batch(_batch(_task("a", len(prompts[0]) + 1))).results[0]
    assert res.resync


def test_release_in_the_same_batch_makes_room(service, prompts) -> None:
    for i in range(SLOTS):
        service.run_batch(_batch(_task(f"r{i}", 0, prompts[i % 3])))
    assert service.verifier.runner.cache.blocks.free_seqs == 0
    resp = service.run_batch(_batch(_task("new", 0, prompts[0]), release=["r0"]))
    assert not resp.results[0].resync and len(resp.results[0].tokens) == 1


def test_more_new_requests_than_free_sequences_is_rejected(service, prompts) -> None:
    blocks = service.verifier.runner.cache.blocks
    tasks = [_task(f"r{i}", 0, prompts[i % 3]) for i in range(SLOTS + 1)]
    with pytest.raises(BatchRejected) as e:
        service.run_batch(_batch(*tasks))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert blocks.free_seqs == SLOTS and len(service.verifier.seqs) == 0  # nothing was touched
    assert blocks.free_blocks == blocks.num_blocks
    service.run_batch(_batch(_task("a", 0, prompts[0]), _task("b", 0, prompts[1])))
    with pytest.raises(BatchRejected) as e:  # 2 held + 3 new > 4
        service.run_batch(_batch(_task("a", len(prompts[0]) + 1),
                                 *[_task(f"n{i}", 0, prompts[2]) for i in range(3)]))
    assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert blocks.free_seqs == SLOTS - 2


@pytest.mark.parametrize("bad", ["token", "negative-token", "parent", "probs", "sampling"])
def test_invalid_task_is_rejected(service, prompts, bad: str) -> None:
    tree = token_tree_pb2.TokenTree(tokens=[5, 6], parents=[-1, 0])
    sampling = SamplingParams()
    if bad == "token":
        tree.tokens[1] = VOCAB
    elif bad == "negative-token":
        tree.tokens[0] = -1
    elif bad == "parent":
        tree.parents[0] = 1
    elif bad == "probs":
        tree.probs.add(dense_f16=np.full(VOCAB, 1.0 / VOCAB, dtype="<f2").tobytes())  # 1 row, 2 nodes
        sampling = SamplingParams(temperature=1.0)
    task = _task("a", 0, prompts[0], tree, sampling)
    if bad == "sampling":
        task.sampling.CopyFrom(sampling_pb2.SamplingParams(temperature=1.0, top_p=0.0))
    with pytest.raises(BatchRejected) as e:
        service.run_batch(_batch(_task("ok", 0, prompts[1]), task))
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(e.value).startswith("a: ")  # names the offending request
    blocks = service.verifier.runner.cache.blocks
    assert blocks.free_seqs == SLOTS and blocks.free_blocks == blocks.num_blocks  # no forward ran


def test_preempted_when_blocks_run_out(prompts, greedy) -> None:
    """Eight blocks of 16 tokens: when a batch does not fit, the youngest requests are answered
    preempted=True (no tokens, not a resync); sent again with the same keep once blocks are
    free, they emit the target's greedy tokens."""
    small = VerifierService(PATH, _config(kv=8 * TBLOCK))
    blocks = small.verifier.runner.cache.blocks
    a = prompts[0] + prompts[2]  # 67 tokens: 5 blocks
    resp = small.run_batch(_batch(_task("a", 0, a), _task("b", 0, prompts[1])))  # + 2 blocks
    assert not any(r.preempted or r.resync for r in resp.results)
    assert (resp.free_blocks, resp.num_blocks) == (1, 8) == (blocks.free_blocks, blocks.num_blocks)
    assert list(resp.results[1].tokens) == greedy[1][:1]
    # a grows by 30 tokens (2 more blocks): c (new, 3 blocks) and then b are preempted
    resp = small.run_batch(_batch(_task("a", len(a) + 1, prompts[0]),
                                  _task("b", len(prompts[1]) + 1),
                                  _task("c", 0, prompts[2]), batch_id=2))
    ra, rb, rc = resp.results
    assert not ra.preempted and len(ra.tokens) == 1
    for r in (rb, rc):
        assert r.preempted and not r.resync and len(r.tokens) == 0 and r.num_accepted == 0
    assert resp.free_blocks == blocks.free_blocks == 1
    resp = small.run_batch(_batch(_task("b", len(prompts[1]) + 1), _task("c", 0, prompts[2]),
                                  batch_id=3, release=["a"]))
    rb, rc = resp.results
    assert not rb.preempted and not rc.preempted
    assert list(rb.tokens) == greedy[1][1:2] and list(rc.tokens) == greedy[2][:1]
    out = {"b": greedy[1][:2], "c": greedy[2][:1]}
    for step in range(3):  # and they go on as if nothing happened
        resp = small.run_batch(_batch(_task("b", len(prompts[1]) + len(out["b"])),
                                      _task("c", len(prompts[2]) + len(out["c"]))))
        for rid, r in zip("bc", resp.results):
            out[rid] += list(r.tokens)
    assert out["b"] == greedy[1][:5] and out["c"] == greedy[2][:4]
    assert resp.free_blocks == blocks.free_blocks


def test_context_limit() -> None:
    """No room for the tree: a plain step; a full context: OUT_OF_RANGE."""
    small = VerifierService(PATH, _config(1, max_model_len=16))
    ctx = tuple(range(100, 113))  # 13 tokens + 3 drafted + 1 > 16
    res = small.run_batch(_batch(_task("a", 0, ctx, TokenTree.chain([1, 2, 3])))).results[0]
    assert len(res.tokens) == 1 and res.num_accepted == 0
    with pytest.raises(BatchRejected) as e:
        small.run_batch(_batch(_task("a", 14, (7, 8))))
    assert e.value.code == grpc.StatusCode.OUT_OF_RANGE


def _speculate(drafter: DrafterService, verifier: VerifierService, rid: str, prompt: tuple[int, ...],
               max_tokens: int, k: int, branching: tuple[int, ...],
               sampling: SamplingParams) -> tuple[list[int], int]:
    """One request through both services the way the router drives them (deltas only);
    the tokens and the number of accepted draft tokens."""
    generated: list[int] = []
    accepted = 0
    d_synced = v_synced = 0
    while len(generated) < max_tokens:
        ctx = prompt + tuple(generated)
        kk = min(k, max_tokens - len(generated) - 1)
        tree = token_tree_pb2.TokenTree()
        if kk > 0:
            task = drafter_pb2.DraftTask(request_id=rid, keep=d_synced, context_delta=ctx[d_synced:],
                                         k=kk, branching=branching,
                                         sampling=sampling_to_proto(sampling))
            res = drafter.run_batch(drafter_pb2.SpeculateRequest(tasks=[task])).results[0]
            assert not res.resync
            d_synced, tree = len(ctx), res.tree
        res = verifier.run_batch(_batch(_task(rid, v_synced, ctx[v_synced:], tree, sampling))).results[0]
        assert not res.resync and res.num_accepted == len(res.tokens) - 1
        v_synced = len(ctx) + len(res.tokens)
        accepted += res.num_accepted
        generated.extend(res.tokens[:max_tokens - len(generated)])
    drafter.run_batch(drafter_pb2.SpeculateRequest(release=[rid]))
    verifier.run_batch(_batch(release=[rid]))
    return generated, accepted


@pytest.mark.parametrize(("k", "branching", "sampling"), [
    (4, (), SamplingParams()),
    (3, (2, 1), SamplingParams()),
    (3, (), SamplingParams(temperature=0.9, top_k=20, seed=5)),
    (2, (2,), SamplingParams(temperature=1.0, seed=77)),
], ids=["greedy-chain", "greedy-tree", "sampled-chain", "sampled-tree"])
def test_drafter_and_verifier_services_reproduce_the_engine(
        service, engine, prompts, greedy, k: int, branching: tuple[int, ...],
        sampling: SamplingParams) -> None:
    """Drafter service -> wire tree -> verifier service equals the in-process engine token for
    token (greedy: equals target-alone greedy; sampled: same seeds, same draws)."""
    drafter = DrafterService("draft-code", DRAFT, RunnerConfig(device="cpu", max_seqs=1,
                                                               kv_cache_memory=8 << 20))
    got, accepted = _speculate(drafter, service, "spec", prompts[0], NEW, k, branching, sampling)
    want = engine.generate([GenerationRequest("spec", prompts[0], NEW, sampling, "draft-code", k,
                                              branching)])[0]
    assert got == want.tokens
    assert accepted == want.accepted > 0  # drafts were really accepted, as in the engine
    if sampling.greedy:
        assert got == greedy[0][:NEW]


def test_two_micro_batches_in_flight_give_the_sequential_outputs(service: VerifierService,
                                                                 prompts, greedy) -> None:
    """The next micro-batch is started (its forward queued) before the previous one finishes:
    disjoint requests interleave start, start, finish, finish; a batch that names a request of
    one still in flight finishes that one first. Every output is the target's own."""
    out: dict[str, list[int]] = {"a": [], "b": []}

    def task(rid: str, i: int) -> verifier_pb2.VerifyTask:
        return _task(rid, len(prompts[i]) + len(out[rid])) if out[rid] else _task(rid, 0, prompts[i])

    for step in range(4):
        first = service.start_batch(_batch(task("a", 0), batch_id=2 * step))
        second = service.start_batch(_batch(task("b", 1), batch_id=2 * step + 1))
        assert first.response is None and second.response is None  # both in flight
        assert first.ready() and second.ready()  # on the CPU the work is done at start
        for rid, pending in (("a", first), ("b", second)):
            resp = pending.finish()
            assert resp is pending.finish()  # idempotent
            out[rid].extend(resp.results[0].tokens)
    assert out["a"] == greedy[0][:4] and out["b"] == greedy[1][:4]
    in_flight = service.start_batch(_batch(task("a", 0), batch_id=20))
    again = service.start_batch(_batch(_task("a", len(prompts[0]) + 5), batch_id=21))
    assert in_flight.response is not None  # finished before "a" was verified again
    out["a"].extend(in_flight.response.results[0].tokens)
    out["a"].extend(again.finish().results[0].tokens)
    assert out["a"] == greedy[0][:6]
    release = service.start_batch(_batch(task("b", 1), batch_id=22))
    service.start_batch(_batch(release=["b"], batch_id=23)).finish()
    assert release.response is not None and len(release.response.results[0].tokens) == 1
