"""``spin bench attention``: attention over the paged KV cache, the paths side by side.

For one layer of a model shape (the demo target's by default: 6 heads of 64) and a few batch
shapes (batch, context, new tokens per request), the median time of:

- ``contiguous``: SDPA over keys already laid out per request (what a preallocated slot cache
  reads; the floor of any paged path);
- ``paged view``: SDPA over one request's blocks read as a view (one run of blocks, batch 1);
- ``paged gather``: gathering every request's blocks through its block table, then SDPA
  (``kv_cache.KVCache.read``);
- ``flex``: FlexAttention with a block mask over contiguous keys, eager and (``--compile``)
  compiled, with its first call's compile time;
- ``paged flex``: ``engine/flex_attention.py``, FlexAttention over the whole pool as one key
  sequence with the block mask built from the block tables (no gather, no dense mask; the
  serving path on CUDA), eager or compiled as ``flex``, with its plan's build time (once per
  forward) and its largest difference from the gather path.

The model runner uses the view for a lone request and the gather otherwise: the view costs what
contiguous keys cost, and on the CPU FlexAttention is slower than SDPA even before a gather is
counted, and compiles for every new shape (serving shapes change every step).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((1, 300, 1), (1, 300, 5), (8, 300, 1), (8, 300, 5), (32, 300, 5), (8, 1000, 5))
"""(batch, context, new tokens per request)."""


def _median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def run_attention_bench(heads: int = 6, head_dim: int = 64, block_size: int = 16,
                        compile_flex: bool = False, reps: int = 30) -> list[dict]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention) if compile_flex else flex_attention
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b, ctx, lq in SHAPES:
        lk = ctx + lq
        width = -(-lk // block_size)
        pool = torch.randn(4096, block_size, heads, head_dim, generator=gen)    # [NB, BS, H, hd]
        table = torch.randperm(4096, generator=gen)[:b * width].view(b, width)  # [B, MB]
        q = torch.randn(b, heads, lq, head_dim, generator=gen)
        mask = None if lq == 1 else torch.ones(b, 1, lq, lk, dtype=torch.bool).tril(ctx)
        keys = pool[table].flatten(1, 2)[:, :lk].transpose(1, 2).contiguous()  # [B, H, Lk, hd]
        row = {"batch": b, "context": ctx, "new_tokens": lq}
        row["contiguous_ms"] = _median_ms(
            lambda: F.scaled_dot_product_attention(q, keys, keys, attn_mask=mask), reps)

        def gather() -> torch.Tensor:
            k = pool[table].flatten(1, 2)[:, :lk].transpose(1, 2)
            v = pool[table].flatten(1, 2)[:, :lk].transpose(1, 2)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        row["paged_gather_ms"] = _median_ms(gather, reps)
        if b == 1:
            run = pool[:width].flatten(0, 1)[None, :lk].transpose(1, 2)
            row["paged_view_ms"] = _median_ms(
                lambda: F.scaled_dot_product_attention(q, run, run, attn_mask=mask), reps)
        block_mask = create_block_mask(lambda _b, _h, qi, ki: ki <= ctx + qi, B=None, H=None,
                                       Q_LEN=lq, KV_LEN=lk, device="cpu")
        start = time.perf_counter()
        flex(q, keys, keys, block_mask=block_mask)
        row["flex_first_call_s"] = time.perf_counter() - start
        row["flex_ms"] = _median_ms(lambda: flex(q, keys, keys, block_mask=block_mask),
                                    reps if compile_flex else 5)
        row.update(_paged_flex(compile_flex, q, pool, table, ctx, lq, reps, gather()))
        rows.append(row)
    return rows


def _paged_flex(compiled: bool, q: torch.Tensor, pool: torch.Tensor,
                table: torch.Tensor, ctx: int, lq: int, reps: int,
                ref: torch.Tensor) -> dict[str, float]:
    """``paged_flex_*`` of one shape: chains of ``lq`` new tokens after ``ctx`` each (eager:
    one timed call after the first; it scores every key of the pool, seconds a call)."""
    from ..engine.flex_attention import build_plan, paged_tree_attention

    b, nb, bs = q.shape[0], pool.shape[0], pool.shape[1]
    ctxs, ns = torch.full((b,), ctx), torch.full((b,), lq)
    plan = build_plan(table, ctxs, ns, lq, nb, bs)
    values = pool.clone()  # compiled flex on the CPU refuses one buffer as both keys and values
    start = time.perf_counter()
    out = paged_tree_attention(q, pool, values, plan, compiled=compiled)
    first = time.perf_counter() - start
    return {"paged_flex_plan_ms": _median_ms(lambda: build_plan(table, ctxs, ns, lq, nb, bs), 10),
            "paged_flex_first_call_s": first, "paged_flex_err": float((out - ref).abs().max()),
            "paged_flex_ms": _median_ms(
                lambda: paged_tree_attention(q, pool, values, plan, compiled=compiled),
                reps if compiled else 1, 3 if compiled else 0)}
