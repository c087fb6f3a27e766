"""Paged + tree attention in one FlexAttention call: no gathered keys, no dense mask.

The SDPA path (``model_runner._attend``) gathers every request's KV blocks through its block
table into [B, KVH, Lk, hd] and masks with a dense [B, 1, Lq, Lk] boolean (context + tree
ancestors). Here the keys are the whole layer pool seen as one sequence, a view
[1, KVH, NB * BS, hd] (no copy), and the sparsity comes from the block tables themselves:

- ``BlockMask.from_kv_blocks`` gets, for item b and every query block, the physical KV blocks of
  b's table (vLLM's "direct build" of its flex backend): the blocks wholly inside the committed
  context as *full* blocks (no mask evaluated), the rest (the context's last partial block and
  the new tokens' blocks: at most ceil((KB - 1 + Lq) / KB) flex blocks of KB tokens) as
  *partial* blocks, cut per query block to the last position its rows can see. Nothing is evaluated over (q, kv) pairs to
  build it: O(B * MB) small index tensors per forward, shared by all layers (``build_plan``).
- the ``mask_mod`` maps a physical key index to item b's logical position through a
  physical -> logical block map [B, NB] and applies the rule of ``model_runner._layout``: new
  token i of item b sees logical position p iff p < ctx[b], or 0 <= p - ctx[b] < n[b] and
  anc[b, i, p - ctx[b]] (a chain: p - ctx[b] <= i). Padding rows (i >= n[b]) see the context,
  or key 0 where there is none: finite, and the same in eager and compiled flex. The rule holds
  on every key (not only the listed blocks), so eager flex (which evaluates the mask densely and
  ignores the block lists) and the kernel (which evaluates it on partial blocks only) agree.

Block sizes: query blocks of ``q_block`` rows (16; queries padded up to a multiple), KV blocks of
16 tokens, or the cache block size where it is smaller (``kv_block_size``: a flex KV block must lie
inside one cache block; the Triton kernel's BLOCK_N must divide it and be >= 16, so on CUDA the
cache block size must be a multiple of 16 — it is, ``kv_cache.BLOCK_SIZE``).

Measured facts behind the choices (this module's tests; ``spin bench attention [--compile]``):

- torch 2.11 (the GPU machine's) has every API used here, read in the 2.11.0 wheel's sources:
  ``BlockMask.from_kv_blocks`` with ``seq_lengths`` and ``compute_q_blocks``; a query batch B
  over a key batch of 1 when the block mask has batch B (checked in ``flex_attention`` and
  accepted by the eager, Triton and flex-decoding lowerings); ``enable_gqa``; ``kernel_options``
  BACKEND ("AUTO", "TRITON", "FLASH", "TRITON_DECODE"), BLOCK_M, BLOCK_N. The Triton lowering
  raises unless BLOCK_M divides the Q block and BLOCK_N the KV block: BLOCK_M = BLOCK_N = 16
  here (default blocks), as vLLM's direct build sets them; BACKEND "TRITON" keeps short queries
  off the flex-decoding kernel (vLLM's FORCE_USE_FLEX_ATTENTION, which 2.11 calls legacy).
- eager flex (any device) is torch's reference implementation: it evaluates the mask over every
  (query, pool key) pair and ignores the block lists; 0.3 s (B=1) to 12 s (B=32) per layer over
  a 4096-block pool on this CPU. Tests only (``test_block_lists_agree_with_the_mask`` checks that
  the block lists the kernel follows select exactly the keys the mask allows).
- compiled flex on the CPU (torch 2.13, inductor's C++ template, one thread, fp32, 6 heads of 64,
  4096 blocks of 16, min of 30): 0.34 ms vs 0.19 ms for SDPA over gathered blocks (B=1, context
  300, 1 new token), 2.6 vs 2.1 ms (B=8, 5 new), 11.2 vs 10.3 ms (B=32, 5 new), 8.3 vs 8.3 ms (B=8,
  context 1000); agrees with it to 7e-7. 5 to 11 s to compile per shape; a new plan of the same
  shapes reuses the kernel. It needs static shapes (``compiled_flex``) and KV block lists as wide
  as the pool (an assert: ``build_plan(cover_pool=True)``, the CPU default). The runner keeps
  SDPA on the CPU: no faster, and it compiles for every new shape.
- building a plan: 0.1 to 0.2 ms on this CPU (B = 1 to 32), once per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 16
"""Query rows per flex query block (the Triton kernel's BLOCK_M must divide it)."""
KV_BLOCK = 16
"""Flex KV block: tokens (a divisor of the cache block size; >= 16 for the Triton kernel)."""


@dataclass(frozen=True)
class FlexPlan:
    """One forward's block mask and sizes, shared by every layer."""

    block_mask: BlockMask
    """Batch B, one head, ``lq_padded`` query rows, NB * BS key positions (the pool)."""
    lq: int
    """Query rows of the caller's batch."""
    lq_padded: int
    """Query rows flex sees (a multiple of the query block; rows past ``lq`` are cut off)."""
    kernel_options: dict[str, object] = field(default_factory=dict)
    """Passed to flex_attention (Triton block sizes on CUDA; nothing on the CPU)."""


def kv_block_size(block_size: int) -> int:
    """The flex KV block for a cache block size: 16 where it divides it, else the block size."""
    return KV_BLOCK if block_size % KV_BLOCK == 0 else block_size


def _block_map(table: Tensor, used: Tensor, num_blocks: int) -> Tensor:
    """table [B, MB] and used [B] blocks per item -> logical block of every physical block for
    each item [B, NB] int32 (-1 where the item does not hold it)."""
    b, mb = table.shape
    cols = torch.arange(mb, device=table.device, dtype=torch.int32).expand(b, mb)     # [B, MB]
    live = cols < used[:, None]
    dest = torch.where(live, table.long(), num_blocks)        # dead entries go to a dump column
    out = torch.full((b, num_blocks + 1), -1, dtype=torch.int32, device=table.device)
    return out.scatter_(1, dest, cols)[:, :num_blocks]                                 # [B, NB]


def _mask_mod(p2l: Tensor, ctx: Tensor, n: Tensor, anc: Tensor | None,
              block_size: int) -> Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]:
    """The visibility rule on physical key indices (see the module docstring). It closes over
    tensors and the pool's block size only: a new plan of the same shapes reuses the compiled
    kernel (measured: no recompile on the CPU)."""

    def mask(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        logical = p2l[b, kv_idx // block_size]
        pos = logical * block_size + kv_idx % block_size              # the item's key position
        c = ctx[b]
        rel = pos - c                                                  # index among new tokens
        real = q_idx < n[b]
        if anc is None:
            tree = (rel >= 0) & (rel <= q_idx)
        else:
            inside = (rel >= 0) & (rel < n[b])
            tree = inside & anc[b, q_idx, torch.where(inside, rel, 0)]
        return (logical >= 0) & ((pos < c) | (real & tree) | (~real & (pos == 0)))

    return mask


def build_plan(table: Tensor, ctx: Tensor, n: Tensor, lq: int, num_blocks: int,
               block_size: int, anc: Tensor | None = None, q_block: int = Q_BLOCK,
               cover_pool: bool | None = None) -> FlexPlan:
    """The block mask of one forward, from small index tensors on the pool's device.

    table [B, MB]: physical cache block of each logical block (padding past an item's blocks is
    ignored); ctx [B]: committed context per item; n [B]: new tokens per item (at logical
    positions ctx .. ctx + n - 1, already written to the pool); lq: padded new tokens per item
    (>= n); num_blocks, block_size: the pool's NB and BS (``k_pool.shape[:2]``);
    anc [B, Lq, Lq] bool: ancestor-or-self among new tokens (None: chains, i.e. causal); ``cover_pool``: KV block lists as wide as the
    pool (compiled flex on the CPU asserts it; default: on CPU devices only)."""
    dev = table.device
    b = table.shape[0]
    kb = kv_block_size(block_size)
    if dev.type == "cuda" and kb < KV_BLOCK:
        raise ValueError(f"flex attention on CUDA needs cache blocks of a multiple of {KV_BLOCK} "
                         f"tokens, got {block_size}")
    r = block_size // kb
    ctx, n = ctx.to(dev, torch.int64), n.to(dev, torch.int64)
    # flex KV blocks of each item, logical order: cache block t -> flex blocks t*r .. t*r+r-1
    ftab = (table.long()[:, :, None] * r + torch.arange(r, device=dev)).flatten(1)  # [B, W]
    width = ftab.shape[1]
    qbn = -(-lq // q_block)
    lq_padded = qbn * q_block
    qend = (torch.arange(1, qbn + 1, device=dev) * q_block)[None]                  # [1, QBn]
    end = (ctx[:, None] + torch.minimum(qend, n[:, None])).clamp(min=1)            # [B, QBn]
    full = (ctx // kb)[:, None].expand(b, qbn)                # blocks wholly inside the context
    partial = (end + kb - 1) // kb - full                     # the rest up to the last visible
    pw = min(width, (2 * kb - 2 + lq) // kb)                  # most partial blocks of one item
    cols = (ctx // kb)[:, None] + torch.arange(pw, device=dev)                     # [B, PW]
    part_idx = ftab.gather(1, cols.clamp(max=width - 1))                           # [B, PW]
    full_idx = ftab
    if cover_pool is None:
        cover_pool = dev.type == "cpu"
    if cover_pool:
        span = num_blocks * r
        part_idx = F.pad(part_idx, (0, span - pw))
        full_idx = F.pad(full_idx, (0, span - width))
    if anc is not None:
        anc = F.pad(anc.to(dev, torch.bool), (0, 0, 0, lq_padded - anc.shape[1]))  # [B, Lqp, Lq]
    # blocks in use; at least one: an item with no tokens (a static batch's padding) sees key 0
    used = ((ctx + n + block_size - 1) // block_size).clamp(min=1)
    p2l = _block_map(table, used, num_blocks)

    def rows(x: Tensor) -> Tensor:                            # [B, X] -> [B, 1, QBn, X] int32
        return x[:, None, None, :].expand(b, 1, qbn, x.shape[1]).to(torch.int32).contiguous()

    mask = BlockMask.from_kv_blocks(
        partial[:, None].to(torch.int32).contiguous(), rows(part_idx),
        full[:, None].to(torch.int32).contiguous(), rows(full_idx),
        BLOCK_SIZE=(q_block, kb), mask_mod=_mask_mod(p2l, ctx, n, anc, block_size),
        seq_lengths=(lq_padded, num_blocks * block_size), compute_q_blocks=False)
    options: dict[str, object] = {}
    if dev.type == "cuda":
        options = {"BACKEND": "TRITON", "BLOCK_M": min(q_block, 64), "BLOCK_N": kb}
    return FlexPlan(mask, lq, lq_padded, options)


_COMPILED: dict[str, Callable[..., Tensor]] = {}


def compiled_flex(device_type: str) -> Callable[..., Tensor]:
    """flex_attention under torch.compile, one per device type and process. On the CPU with
    static shapes (one compile per shape): with dynamic shapes inductor's C++ template emits code
    that does not build once the mask reads captured tensors (torch 2.13: "cur_qSplitSize9 was
    not declared"). On CUDA with torch's default (dynamic after a shape changes)."""
    if device_type not in _COMPILED:
        dynamic = False if device_type == "cpu" else None
        _COMPILED[device_type] = torch.compile(flex_attention, fullgraph=True, dynamic=dynamic)
    return _COMPILED[device_type]


def paged_tree_attention(q: Tensor, k_pool: Tensor, v_pool: Tensor, plan: FlexPlan,
                         compiled: bool | None = None) -> Tensor:
    """Attention of q [B, H, Lq, hd] (rope applied) over one layer's pool k_pool/v_pool
    [NB, BS, KVH, hd] under ``plan`` -> [B, H, Lq, hd]. ``compiled``: torch.compile'd flex
    (default: on CUDA; eager flex, the reference implementation, elsewhere)."""
    b, h, lq, hd = q.shape
    nb, bs, kvh, _ = k_pool.shape
    keys = k_pool.view(1, nb * bs, kvh, hd).transpose(1, 2)                        # [1, KVH, NB*BS, hd]
    values = v_pool.view(1, nb * bs, kvh, hd).transpose(1, 2)
    if plan.lq_padded > lq:
        q = F.pad(q, (0, 0, 0, plan.lq_padded - lq))                              # [B, H, Lqp, hd]
    if compiled is None:
        compiled = q.device.type == "cuda"
    fn = compiled_flex(q.device.type) if compiled else flex_attention
    out = fn(q, keys, values, block_mask=plan.block_mask, enable_gqa=h != kvh,
             kernel_options=plan.kernel_options or None)
    return out[:, :, :lq]                                                          # [B, H, Lq, hd]
