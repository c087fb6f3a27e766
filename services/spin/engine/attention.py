"""Attention of a ragged batch over the paged KV cache: the batch's index tensors, and the two
ways to attend.

- ``sdpa``: each request's blocks gathered through its block table (a view when they form one
  run) into [B, KVH, Lk, hd], then SDPA with a dense [B, 1, Lq, Lk] mask (``ragged_layout``).
  The default: on the CPU it beats FlexAttention, compiled or not (``spin bench attention``).
- ``flex``: FlexAttention over the whole pool with a block mask built from the block tables and
  the token tree (``flex_attention.py``): no gather, no dense mask. For CUDA, where a gathered
  batch of long contexts costs a copy of its keys every layer.

A new token of request b at tree index i sees key position p iff p is in b's committed context
(p < ctx[b]) or p - ctx[b] is i or one of i's ancestors among the new tokens; a padding row sees
key 0 (finite, never used).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from .transfer import to_device
from .tree import ancestors

AttentionMode = Literal["sdpa", "flex"]
"""``sdpa``: gathered keys and a dense mask; ``flex``: FlexAttention over the pool."""


class Iota:
    """0 .. n-1 on a device (slices of one tensor, grown by doubling)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._t = torch.arange(0, device=device)

    def __call__(self, n: int) -> torch.Tensor:
        if len(self._t) < n:
            self._t = torch.arange(max(n, 2 * len(self._t)), device=self.device)
        return self._t[:n]


def ragged_layout(tokens: list[list[int] | tuple[int, ...]],
                  parents: list[tuple[int, ...] | None], ctx_lengths: list[int], lk: int,
                  iota: Iota, dense_mask: bool = True) -> dict[str, torch.Tensor | None]:
    """Padded index tensors of a ragged batch: item i feeds ``tokens[i]`` (tree ``parents[i]``,
    None = a chain) after ``ctx_lengths[i]`` committed tokens; ``lk`` keys at most. Keys:
    tokens/valid/positions [B, Lq], ctx/n [B], anc [B, Lq, Lq] bool (None: all chains), mask
    [B, 1, Lq, Lk] (None: a lone token, or ``dense_mask`` off)."""
    b, dev = len(tokens), iota.device
    sizes = [len(t) for t in tokens]
    lq = max(sizes)
    ar = iota(lk + 1)
    pad = [lq - n for n in sizes]
    ids = to_device([list(t) + [0] * p for t, p in zip(tokens, pad)], dev)           # [B, Lq]
    ctx = to_device(ctx_lengths, dev)                                                # [B]
    n = to_device(sizes, dev)                                                        # [B]
    valid = ar[None, :lq] < n[:, None]                                                # [B, Lq]
    anc = None
    if all(p is None for p in parents):  # causal, depth = index + 1
        depth = ar[None, 1:lq + 1].expand(b, lq)
    else:  # ancestors on the host (a loop over depths), then one copy
        table = torch.tensor([list(p if p is not None else range(-1, len(t) - 1)) + [-1] * k
                              for t, p, k in zip(tokens, parents, pad)])              # [B, Lq]
        anc, depth = (to_device(x, dev) for x in ancestors(table))
    positions = ctx[:, None] + depth - 1                                              # [B, Lq]
    out = {"tokens": ids, "valid": valid, "positions": positions, "ctx": ctx, "n": n,
           "anc": anc, "mask": None}
    if (lq == 1 and b == 1) or not dense_mask:  # a lone token sees the whole context
        return out
    rel = ar[None, None, :lk] - ctx[:, None, None]                                    # [B, 1, Lk]
    if anc is None:
        tree_part = (rel <= ar[None, :lq, None]) & (rel < n[:, None, None])           # [B, Lq, Lk]
    else:
        in_tree = (rel >= 0) & (rel < n[:, None, None])
        tree_part = anc.gather(2, rel.clamp(0, lq - 1).expand(b, lq, lk)) & in_tree
    mask = (rel < 0) | tree_part
    mask = mask | (~valid[:, :, None] & (ar[:lk] == 0))                               # pad rows
    out["mask"] = mask[:, None]                                                       # [B, 1, Lq, Lk]
    return out


def sdpa(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
         batch_invariant: bool = False) -> torch.Tensor:
    """Attention of q [B, H, Lq, hd] over keys/values [B, KVH, Lk, hd] -> [B, H, Lq, hd].

    SDPA, except with ``batch_invariant``: the arithmetic in float64, then rounded to the
    model's dtype. A bf16 SDPA over keys masked past a row's context (a batch padded to its
    longest request, or a prefill's later tokens) rounds differently from one over exactly
    that row's keys (one ulp, often: measured on CPU, in fp32 too at 1e-7); with a 150k
    vocabulary one ulp flips a greedy argmax often enough that a request's output would
    depend on what shares its batch. In float64 the masked keys add exact zeros and the
    rounding to bf16 no longer depends on them (0 differing outputs in 200 random shapes,
    where float32 math gave 36)."""
    heads, kv_heads = q.shape[1], keys.shape[1]
    if not batch_invariant:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=kv_heads != heads)
    rep = heads // kv_heads
    k = keys.double().repeat_interleave(rep, 1)                                       # [B, H, Lk, hd]
    v = values.double().repeat_interleave(rep, 1)
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5                 # [B, H, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (torch.softmax(scores, -1) @ v).to(q.dtype)
