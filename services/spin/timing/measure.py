"""Step times measured on this machine: target forwards (verification) and drafter calls.

Verification: one target forward over ``batch`` requests, each scoring ``tokens`` new tokens after
a context of ``context`` tokens, as a chain and (where the count allows) as a tree of two
branches. Drafting: one drafter call drafting k levels for ``batch`` requests after a context
(catch-up of the last token included, as in serving); a draft head's drafts inside the
verifier likewise (``profile_head``). Each point is the fastest of a few repetitions after a
warm-up, repeated further while the two fastest disagree (``steady_time``). The services
measure themselves with these at start (``rpc/step_times.py``); ``spin profile`` fits a
``CostModel`` file from them (``bench/profile.py``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from ..engine.drafter import DraftRequest, ModelDrafter
from ..engine.head_runner import DraftTask, FeatureLog, HeadRunner
from ..engine.model_runner import ForwardItem, ModelRunner
from ..engine.sampling import SamplingParams
from .cost_model import DraftSample, VerifySample

GREEDY = SamplingParams()


STEADY_TOLERANCE = 0.1
"""How near the two fastest timings of a point must be to end its measurement."""


def steady_time(fn: Callable[[], object], reps: int) -> float:
    """The fastest of at least ``reps`` timed calls of ``fn`` after one untimed warm-up call,
    timing more (``4 * reps`` in all at most) until the two fastest agree within
    ``STEADY_TOLERANCE``. Another process only ever makes a call slower (a preempted OpenMP
    team waits at its barrier: on 2 cores beside two busy processes a 48 ms forward took 616 ms,
    and the median of three kept such points), so the fastest of two that agree is the call's
    own time."""
    fn()  # warm-up
    times: list[float] = []
    while len(times) < 4 * reps:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        if len(times) >= max(reps, 2):
            a, b = sorted(times)[:2]
            if b <= a * (1 + STEADY_TOLERANCE):
                break
    return min(times)


@torch.inference_mode()
def profile_verify(runner: ModelRunner, batches: Sequence[int], tokens: Sequence[int],
                   contexts: Sequence[int], reps: int, bar: tqdm) -> list[VerifySample]:
    """Target forwards over the grid; points the KV cache cannot hold at once are skipped."""
    samples = []
    blocks = runner.cache.blocks
    for ctx in contexts:
        for b in batches:
            if b * blocks.blocks_for(ctx + max(tokens)) > blocks.num_blocks:
                bar.update(len(tokens))  # more than the cache holds at once
                continue
            seqs = [blocks.admit(f"profile-{i}") for i in range(b)]
            try:
                prefix = tuple(range(3, 3 + ctx))
                for s in seqs:
                    runner.forward([ForwardItem(s, prefix)])
                    runner.cache.commit(s, ctx)
                for n in tokens:
                    items = [ForwardItem(s, tuple(range(5, 5 + n))) for s in seqs]
                    secs = steady_time(lambda: runner.forward(items), reps)
                    samples.append(VerifySample(b, b * n, b * ctx, secs))
                    bar.update()
                    if n > 1 and (n - 1) % 2 == 0 and b <= 16:  # as many tokens, as a tree
                        half = (n - 1) // 2  # the context's last token, two branches of half
                        parents = (-1, 0, *range(1, half), 0, *range(half + 1, n - 1))
                        trees = [ForwardItem(s, tuple(range(5, 5 + n)), parents) for s in seqs]
                        secs = steady_time(lambda: runner.forward(trees), reps)
                        samples.append(VerifySample(b, b * n, b * ctx, secs, tree=True))
            finally:
                for s in seqs:
                    blocks.free(s)
    return samples


@torch.inference_mode()
def profile_draft(name: str, drafter: ModelDrafter, batches: Sequence[int], ks: Sequence[int],
                  contexts: Sequence[int], reps: int, bar: tqdm) -> list[DraftSample]:
    """Draft calls of ``drafter`` over the grid; points its cache cannot hold are skipped."""
    samples = []
    blocks = drafter.runner.cache.blocks
    for ctx in contexts:
        for b in batches:
            if (b * blocks.blocks_for(ctx + max(ks) + 1) > blocks.free_blocks
                    or b > blocks.free_seqs):
                bar.update(len(ks))  # more than the cache holds at once
                continue
            ids = [f"profile-{name}-{ctx}-{b}-{i}" for i in range(b)]
            contexts_ = [tuple(range(3 + i, 3 + i + ctx)) for i in range(b)]
            try:
                for k in ks:
                    drafter.propose([DraftRequest(rid, c, k, keep=0)  # prefill once
                                     for rid, c in zip(ids, contexts_)])
                    # timed: the context as it is, then one more token (a catch-up of one)
                    same = [DraftRequest(rid, (), k, keep=ctx) for rid in ids]
                    step = [DraftRequest(rid, (7,), k, keep=ctx) for rid in ids]
                    secs = steady_time(lambda: (drafter.propose(same), drafter.propose(step)),
                                        reps) / 2
                    samples.append(DraftSample(name, b, k, b * ctx, secs))
                    bar.update()
                    if k > 1 and b <= 4:  # the same levels as a tree of two branches
                        same = [DraftRequest(rid, (), k, (2,), keep=ctx + 1) for rid in ids]
                        step = [DraftRequest(rid, (8,), k, (2,), keep=ctx + 1) for rid in ids]
                        secs = steady_time(lambda: (drafter.propose(same),
                                                     drafter.propose(step)), reps) / 2
                        samples.append(DraftSample(name, b, k, b * ctx, secs, tree=True))
            finally:
                for rid in ids:
                    drafter.release(rid)
    return samples


@torch.inference_mode()
def profile_head(name: str, head: HeadRunner, width: int, batches: Sequence[int],
                 ks: Sequence[int], contexts: Sequence[int], reps: int, bar: tqdm
                 ) -> list[DraftSample]:
    """A draft head's drafts over the grid, as in serving: after a verdict that committed one
    more position (its target states from ``width``-wide random ones), the head catches up
    and drafts k levels; points its cache cannot hold are skipped."""
    samples = []
    blocks = head.cache.blocks
    grows = (reps + 1) * len(ks)  # positions the timed steps add to each request
    log = FeatureLog(max(contexts) + grows + 1)
    dev, dtype = head.embed.device, head.embed.dtype
    for ctx in contexts:
        for b in batches:
            if (b * blocks.blocks_for(ctx + max(ks) + grows + 1) > blocks.free_blocks
                    or b > blocks.free_seqs):
                bar.update(len(ks))
                continue
            ids = [f"profile-{name}-{ctx}-{b}-{i}" for i in range(b)]
            ctxs = {rid: list(range(3 + i, 4 + i + ctx)) for i, rid in enumerate(ids)}
            for rid in ids:
                log.record(rid, 0, torch.randn(ctx, width, device=dev, dtype=dtype))
            try:
                for k in ks:
                    head.draft([DraftTask(rid, ctxs[rid], k, GREEDY) for rid in ids], log)

                    def step() -> None:  # one more committed position, then the draft
                        for rid in ids:
                            log.record(rid, len(ctxs[rid]) - 1,
                                       torch.randn(1, width, device=dev, dtype=dtype))
                            ctxs[rid].append(7)
                        head.draft([DraftTask(rid, ctxs[rid], k, GREEDY) for rid in ids], log)

                    samples.append(DraftSample(name, b, k, b * ctx, steady_time(step, reps)))
                    bar.update()
            finally:
                for rid in ids:
                    head.release(rid)
                    log.release(rid)
    return samples
