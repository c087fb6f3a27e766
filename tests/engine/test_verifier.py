"""The verifier under churn (random admit / draft / verify / rollback / free), and when its KV
cache runs out of blocks (trees dropped, then the youngest requests preempted)."""

import random
from pathlib import Path

import pytest
import torch

from spin.engine.drafter import DraftRequest, ModelDrafter, PromptLookupDrafter
from spin.engine.engine import GenerationRequest, SpecEngine
from spin.engine.model_runner import ModelRunner
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest
from spin.zoo.corpus import heldout_prompts
from spin.zoo.distill import greedy_continue

SLOTS = 4
TBLOCK = 2 * 8 * 6 * 64 * 4 * 16  # one KV block of the demo target in fp32 (16 tokens)
EMPTY = TokenTree((), ())


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_blocks(verifier: Verifier) -> None:
    """After a step every request's cache holds its context but the last token, in exactly
    the blocks that needs."""
    blocks = verifier.runner.cache.blocks
    for s in verifier.seqs:
        if blocks.lengths[s.seq]:
            assert blocks.lengths[s.seq] == len(s.context) - 1
        assert len(blocks.tables[s.seq]) == blocks.blocks_for(blocks.lengths[s.seq])
    held = {b for s in verifier.seqs for b in blocks.tables[s.seq]}  # shared blocks count once
    assert blocks.free_blocks + len(held) == blocks.num_blocks


@pytest.mark.parametrize("stems", [0, 2])
def test_random_operations_leak_nothing_and_keep_outputs_equal(family_dir: Path, target,
                                                               stems: int) -> None:
    """``stems``: contexts start with a cut of one of this many shared token runs (prefixes
    found in the prefix caches of the verifier and the drafter, shared, rolled back into)."""
    rng = random.Random(3)
    shared = [[rng.randrange(1, 4000) for _ in range(40)] for _ in range(stems)]
    verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=SLOTS, max_model_len=192,
                                    kv_cache_bytes=64 * TBLOCK))
    drafters = {"code": ModelDrafter("code", ModelRunner(family_dir / "draft-code",
                                                         max_seqs=SLOTS, kv_cache_bytes=4 << 20)),
                "lookup": PromptLookupDrafter()}
    live: dict[str, list[int]] = {}
    held: dict[str, dict[str, list[int]]] = {"verifier": {}, "code": {}, "lookup": {}}

    def sync(who: str, rid: str) -> tuple[int, tuple[int, ...]]:
        """(keep, delta) for ``who``: the whole context, or what changed since it last saw it."""
        keep = 0 if rng.random() < 0.3 else _common(held[who].get(rid, []), live[rid])
        held[who][rid] = list(live[rid])
        return keep, tuple(live[rid][keep:])

    checked = 0
    for op_index in range(1000):
        op = rng.choice(["admit", "step", "step", "step", "rollback", "free"])
        if op == "admit" and len(live) < SLOTS:
            stem = rng.choice(shared)[:rng.randint(0, 40)] if shared else []
            live[f"r{op_index}"] = stem + [rng.randrange(1, 4000)
                                           for _ in range(rng.randint(1, 12))]
        elif op == "rollback" and live:  # the context shrinks (e.g. a client edits history)
            rid = rng.choice(sorted(live))
            live[rid] = live[rid][:rng.randint(1, len(live[rid]))]
        elif op == "free" and live:
            rid = rng.choice(sorted(live))
            del live[rid]
            verifier.release(rid)
            for name, d in drafters.items():
                d.release(rid)
                held[name].pop(rid, None)
            held["verifier"].pop(rid, None)
        elif op == "step" and live:
            batch = rng.sample(sorted(live), rng.randint(1, len(live)))
            trees = {}
            for rid in batch:
                name = rng.choice(["code", "lookup", None])
                k = rng.randint(1, 4)
                if name and len(live[rid]) + k + 1 < 192:
                    keep, delta = sync(name, rid)
                    req = DraftRequest(rid, delta, k, (2,) if rng.random() < 0.3 else (),
                                       keep=keep)
                    trees[rid] = drafters[name].propose([req])[0]
                else:
                    trees[rid] = EMPTY
            verdicts = verifier.verify([_verify_request(rid, sync("verifier", rid), trees[rid])
                                        for rid in batch])
            assert all(v is not None for v in verdicts)  # the cache has room for every one
            # every emitted token is the target's greedy choice after those before it: one
            # teacher-forced forward of the step's contexts, padded on the right (causal: the
            # padding changes no row before it)
            full = [list(live[rid]) + list(v.tokens) for rid, v in zip(batch, verdicts)]
            width = max(map(len, full))
            with torch.inference_mode():
                greedy = target(input_ids=torch.tensor([f + [0] * (width - len(f))
                                                        for f in full])).logits.argmax(-1)
            for b, (rid, v) in enumerate(zip(batch, verdicts)):
                ctx = list(live[rid])
                if v.tokens:
                    assert greedy[b, len(ctx) - 1:len(full[b]) - 1].tolist() == list(v.tokens)
                    ctx += v.tokens
                    checked += len(v.tokens)
                assert verifier.seqs[rid].context == ctx  # it appended what it emitted
                held["verifier"][rid] = list(ctx)
                live[rid] = ctx if len(ctx) < 150 else ctx[:20]
            _check_blocks(verifier)
        blocks = verifier.runner.cache.blocks
        assert SLOTS - blocks.free_seqs == len(verifier.seqs) <= len(live)
        code = drafters["code"].runner.cache.blocks
        assert SLOTS - code.free_seqs == len(drafters["code"].seqs)
    for rid in list(live):
        verifier.release(rid)
        drafters["code"].release(rid)
    for runner in (verifier.runner, drafters["code"].runner):
        blocks = runner.cache.blocks
        assert blocks.free_seqs == SLOTS and blocks.free_blocks == blocks.num_blocks
    assert checked > 300
    if stems:  # prefixes were found, by the verifier and by the drafter
        assert verifier.runner.cache.blocks.prefix.hits > 0
        assert drafters["code"].runner.cache.blocks.prefix.hits > 0


def _verify_request(rid: str, sync: tuple[int, tuple[int, ...]], tree: TokenTree,
                    sampling: SamplingParams = SamplingParams()) -> VerifyRequest:
    keep, delta = sync
    return VerifyRequest(rid, delta, tree, sampling, keep=keep)


def _next(target, ctx) -> int:
    with torch.inference_mode():
        return int(target(input_ids=torch.tensor([list(ctx)])).logits[0, -1].argmax())


def test_trees_are_dropped_then_the_youngest_preempted(family_dir: Path, target) -> None:
    """Eight blocks of 16 tokens. A tree that does not fit is dropped (a plain step); when
    that is not enough the youngest requests lose their cache and get no verdict; verified
    again they recompute it and emit the target's greedy tokens."""
    verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=SLOTS, max_model_len=128,
                                    kv_cache_bytes=8 * TBLOCK))
    blocks = verifier.runner.cache.blocks
    gen = torch.Generator().manual_seed(0)
    a, b, c, more = (torch.randint(1, 4000, (n,), generator=gen).tolist() for n in (60, 40, 20, 40))
    ctx = {"a": list(a), "b": list(b), "c": list(c)}

    def step(*reqs: VerifyRequest) -> list:
        out = verifier.verify(list(reqs))
        for r, v in zip(reqs, out):
            for tok in v.tokens if v is not None else ():  # the target's greedy tokens
                assert tok == _next(target, ctx[r.request_id])
                ctx[r.request_id].append(tok)
        _check_blocks(verifier)
        return out

    va, vb = step(VerifyRequest("a", a, EMPTY), VerifyRequest("b", b, EMPTY))  # 4 + 3 blocks
    assert va is not None and vb is not None and blocks.free_blocks == 1
    # b's 30-token chain (its greedy rollout: all of it would be accepted) needs two more
    # blocks: it is dropped
    chain = list(b) + list(vb.tokens)
    rollout = []
    for _ in range(30):
        rollout.append(_next(target, chain + rollout))
    va, vb = step(VerifyRequest("a", (), EMPTY, keep=61),
                  VerifyRequest("b", (), TokenTree.chain(rollout), keep=41))
    assert va.num_accepted == 0 and vb.num_accepted == 0 and vb.tokens == (rollout[0],)
    # a grows by 40 tokens (3 more blocks): c (new) and then b are preempted, a goes on
    ctx["a"] += more
    va, vb, vc = step(VerifyRequest("a", more, EMPTY, keep=62),
                      VerifyRequest("b", (), EMPTY, keep=42), VerifyRequest("c", c, EMPTY))
    assert va is not None and vb is None and vc is None
    assert blocks.lengths[verifier.seqs["b"].seq] == 0 and blocks.tables[verifier.seqs["b"].seq] == []
    assert verifier.seqs["b"].context == ctx["b"] and verifier.seqs["c"].context == list(c)
    verifier.release("a")
    for _ in range(3):  # b recomputes its cache, c prefills: both emit the target's tokens
        vb, vc = step(VerifyRequest("b", (), EMPTY, keep=len(ctx["b"])),
                      VerifyRequest("c", (), EMPTY, keep=len(ctx["c"])))
        assert vb is not None and vc is not None
    assert ctx["b"][len(b):] == greedy_continue(target, torch.tensor([b]), 5)[0].tolist()
    assert ctx["c"][len(c):] == greedy_continue(target, torch.tensor([c]), 3)[0].tolist()
    verifier.release("b")
    verifier.release("c")
    assert blocks.free_blocks == blocks.num_blocks


class _Spy:
    """Records every verify call's request ids and verdicts."""

    def __init__(self, verifier: Verifier) -> None:
        self.calls: list[tuple[list[str], list]] = []
        self._verify = verifier.verify
        verifier.verify = self  # type: ignore[method-assign]

    def __call__(self, requests, split=None):
        out = self._verify(requests, split)
        self.calls.append(([r.request_id for r in requests], out))
        return out

    def preempted(self, rid: str) -> int:
        return sum(v is None for ids, out in self.calls for i, v in zip(ids, out) if i == rid)


@pytest.fixture(scope="module")
def tiny_engine(family_dir: Path) -> SpecEngine:
    """A target with eight KV blocks (128 tokens) and draft-code."""
    verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=SLOTS, max_model_len=128,
                                    kv_cache_bytes=8 * TBLOCK))
    drafter = ModelDrafter("draft-code", ModelRunner(family_dir / "draft-code", max_seqs=SLOTS,
                                                     kv_cache_bytes=4 << 20))
    return SpecEngine(verifier, {"draft-code": drafter}, eos_id=None)


def _prompts(family_dir: Path, tokenizer, n: int, length: int) -> list[tuple[int, ...]]:
    rows = heldout_prompts(family_dir)[::7]
    ids = [tokenizer(r["prompt"] + r["reference"], add_special_tokens=False)["input_ids"]
           for r in rows]
    return [tuple(i[:length]) for i in ids if len(i) >= length][:n]


def test_preempted_requests_finish_with_target_alone_greedy_tokens(
        tiny_engine: SpecEngine, family_dir: Path, tokenizer, target) -> None:
    """Three requests of 30 + 24 tokens (4 blocks each) in 8 blocks, drafting with draft-code:
    the youngest are preempted and retried; every output is target-alone greedy."""
    prompts = _prompts(family_dir, tokenizer, 3, 30)
    spy = _Spy(tiny_engine.verifier)
    try:
        results = tiny_engine.generate([GenerationRequest(f"g{i}", p, 24, drafter="draft-code",
                                                          k=3) for i, p in enumerate(prompts)])
    finally:
        del tiny_engine.verifier.verify
    ref = greedy_continue(target, torch.tensor(prompts), 24).tolist()
    assert [r.tokens for r in results] == ref
    assert spy.preempted("g2") > 0 and spy.preempted("g0") == 0
    for ids, out in spy.calls:  # the preempted are always the youngest of their batch
        flags = [v is None for v in out]
        assert flags == sorted(flags), (ids, flags)
    assert sum(r.accepted for r in results) > 0
    blocks = tiny_engine.verifier.runner.cache.blocks
    assert blocks.free_blocks == blocks.num_blocks and blocks.free_seqs == SLOTS


def test_seeded_sampling_is_the_same_when_preempted(tiny_engine: SpecEngine, family_dir: Path,
                                                    tokenizer) -> None:
    """Target alone, seeded: a request preempted for several steps emits what it emits alone
    (its generator is kept and draws nothing while it waits)."""
    old = _prompts(family_dir, tokenizer, 2, 40)
    x = GenerationRequest("x", _prompts(family_dir, tokenizer, 3, 20)[2], 24,
                          SamplingParams(temperature=1.0, top_k=50, seed=9))
    alone = tiny_engine.generate([x])[0].tokens
    spy = _Spy(tiny_engine.verifier)
    try:
        crowd = tiny_engine.generate([GenerationRequest(f"o{i}", p, 24)
                                      for i, p in enumerate(old)] + [x])
    finally:
        del tiny_engine.verifier.verify
    assert spy.preempted("x") > 0
    assert crowd[-1].tokens == alone
    again = tiny_engine.generate([x])[0].tokens
    assert again == alone


def test_started_steps_finish_as_verify_would(family_dir: Path) -> None:
    """``start`` queues a step, ``finish`` commits it (once, however often it is asked); two
    steps of disjoint requests started back to back give what ``verify`` gives one by one."""
    make = lambda: Verifier(ModelRunner(family_dir / "target", max_seqs=SLOTS,  # noqa: E731
                                        kv_cache_bytes=64 * TBLOCK))
    ids = [tuple(range(5, 25)), tuple(range(40, 57))]
    one_by_one, interleaved = make(), make()
    want = [[one_by_one.verify([VerifyRequest(f"r{i}", p, EMPTY)])[0].tokens for i, p in
             enumerate(ids)]]
    first = interleaved.start([VerifyRequest("r0", ids[0], EMPTY)])
    second = interleaved.start([VerifyRequest("r1", ids[1], EMPTY)])
    assert first.ready() and second.ready()
    got = [[first.finish()[0].tokens, second.finish()[0].tokens]]
    assert first.finish() is first.finish()
    assert got == want
    assert interleaved.start([]).finish() == []
    for v in (one_by_one, interleaved):
        assert [len(s.context) for s in v.seqs] == [len(ids[0]) + 1, len(ids[1]) + 1]
