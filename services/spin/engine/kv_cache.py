"""Keys and values of every layer in fixed-size blocks, under a memory budget.

Layout per layer: [num_blocks, block_size, kv_heads, head_dim] (vLLM's layout), the blocks handed
out by a ``BlockManager``. The number of blocks comes from a byte budget (``--kv-cache-memory``),
never from a model's context: a request holds the blocks of the tokens it has.

A forward (``model_runner.py``) writes its new tokens' keys and values at positions
``lengths[seq] + i`` but does not commit them: the caller commits what verification accepted
(``commit``, which gives back the blocks past the new length) or rolls back. Tree verification
accepts a path whose nodes need not be contiguous: ``compact`` moves their entries into place.

Attention reads a batch's keys as [B, KVH, Lk, hd]. One sequence whose blocks form one ascending
run (the usual case for a request decoding alone: ``BlockManager.reserve`` takes the next block
when it is free) is read as a view, without a copy; otherwise the blocks are gathered through the
block tables (SDPA over gathered blocks; ``model_runner.py`` has the measurements behind the
choice).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .block_manager import BlockManager, CacheFull
from .transfer import to_device

__all__ = ["BlockManager", "CacheFull", "KVCache", "Paged"]

BLOCK_SIZE = 16
"""Tokens per block (vLLM's default)."""


@dataclass(frozen=True)
class Paged:
    """Where one forward's new tokens are written and which cache entries its attention reads."""

    lk: int
    """Key positions read per item: max over items of context + new tokens."""
    run: tuple[torch.Tensor, torch.Tensor, int] | None
    """One sequence in one run of blocks: keys and values of its positions in every layer as
    views [L, positions, KVH, hd], and the position of its first new token; writes and reads
    are views. None: the indexed path below."""
    write_block: torch.Tensor | None = None
    """[T] block of each valid new token (items' tokens in order, padding skipped)."""
    write_offset: torch.Tensor | None = None
    """[T] offset in that block."""
    rows: tuple[torch.Tensor, torch.Tensor] | None = None
    """([T], [T]) item and token index of each valid new token in the padded [B, Lq] batch."""
    table: torch.Tensor | None = None
    """[B, blocks_for(lk)] block table of each item (padded with block 0: masked positions)."""
    slots: torch.Tensor | None = None
    """[B * Lq] flat slot (block * block_size + offset) of every new token, padding included
    (padding writes to the scratch block): the static-shape steps of ``step_graphs.py``, which
    write without dropping padding so that every step of a bucket runs the same kernels."""


def _write_slots(pool: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor
                 ) -> None:
    """pool[layer] viewed as [NB * BS, KVH, hd] gets ``values`` [T, KVH, hd] at ``slots`` [T]."""
    pool[layer].flatten(0, 1).index_copy_(0, slots, values)


@torch.library.custom_op("spin::write_slots", mutates_args=("pool",))
def write_slots(pool: torch.Tensor, layer: int, slots: torch.Tensor, values: torch.Tensor
                ) -> None:
    """``_write_slots`` as an operator of its own, for compiled steps: traced as a plain
    ``index_copy_`` into the cache, inductor copied the whole pool every step (a step of
    draft-general at batch 1 took 22.9 ms compiled against 2.7 ms eager in a one-off timing on
    this project's CPU; 2.9 ms with this operator). Eager steps call ``_write_slots`` (an
    operator call costs about 30 us of Python)."""
    _write_slots(pool, layer, slots, values)


class KVCache:
    """A pool of KV blocks for ``num_layers`` layers and the bookkeeping of its sequences."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, head_dim: int,
                 max_seqs: int, block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", scratch: bool = False,
                 zeroed: bool = False, prefix_caching: bool = False) -> None:
        """``scratch``: one block more than ``num_blocks``, never handed out, where padded tokens
        of static-shape steps write and which padded block-table entries read (zeros and
        finite values only: a masked key must not carry a NaN into attention). ``zeroed``: the
        whole pool zeroed at once, for attention that reads keys of blocks never handed out
        (eager FlexAttention scores the whole pool; 0 x NaN from uninitialised memory is NaN).
        ``prefix_caching``: full context blocks are shared across requests
        (``prefix_cache.py``)."""
        shape = (num_layers, num_blocks + int(scratch), block_size, kv_heads, head_dim)
        # empty, not zeros: a block is zeroed when first taken (``reserve``), so on CPU the
        # budget becomes resident as it is used, not all at start
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.blocks = BlockManager(num_blocks, block_size, max_seqs, prefix_caching)
        self.block_size = block_size
        self.device = torch.device(device)
        self._zeroed = bytearray(num_blocks)  # blocks ever written: nothing uninitialised is read
        if zeroed:
            self.k.zero_()
            self.v.zero_()
            self._zeroed = bytearray(b"\x01" * num_blocks)
        self.scratch: int | None = num_blocks if scratch else None
        """Index of the scratch block (None without one)."""
        if scratch:
            self.k[:, num_blocks] = 0
            self.v[:, num_blocks] = 0

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Keys and values of one token position in every layer."""
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def lengths(self) -> list[int]:
        return self.blocks.lengths

    @property
    def usage(self) -> float:
        """Share of the blocks in use (``spin:kv_cache_usage_perc``)."""
        return self.blocks.used_blocks / self.blocks.num_blocks

    def reserve(self, seq: int, tokens: int) -> None:
        """Blocks for ``tokens`` positions of ``seq`` (``CacheFull`` when too few are free)."""
        new = [b for b in self.blocks.reserve(seq, tokens) if not self._zeroed[b]]
        if new:
            idx = to_device(new, self.device)
            self.k[:, idx] = 0
            self.v[:, idx] = 0
            for b in new:
                self._zeroed[b] = 1

    def commit(self, seq: int, length: int) -> None:
        self.blocks.commit(seq, length)

    def rollback(self, seq: int, length: int) -> None:
        self.blocks.rollback(seq, length)

    # ---- a forward's view ------------------------------------------------------------------------
    def locate(self, seqs: list[int], sizes: list[int], lq: int, view: bool = True) -> Paged:
        """The ``Paged`` of a forward whose item i feeds ``sizes[i]`` new tokens to sequence
        ``seqs[i]`` (blocks already reserved), padded to ``lq``; ``view``: a lone sequence in
        one run of blocks is read as a view (else always through a block table)."""
        bs, lengths, tables = self.block_size, self.blocks.lengths, self.blocks.tables
        lk = max(lengths[s] + n for s, n in zip(seqs, sizes))
        width = -(-lk // bs)
        if view and len(seqs) == 1 and (first := self.blocks.contiguous(seqs[0])) is not None:
            span = slice(first, first + width)
            return Paged(lk, (self.k[:, span].flatten(1, 2), self.v[:, span].flatten(1, 2),
                              lengths[seqs[0]]))
        blocks, offsets, items, cols = [], [], [], []
        for i, (s, n) in enumerate(zip(seqs, sizes)):
            table, start = tables[s], lengths[s]
            for j in range(n):
                pos = start + j
                blocks.append(table[pos // bs])
                offsets.append(pos % bs)
            items.extend([i] * n)
            cols.extend(range(n))
        dev = self.device
        table = to_device([tables[s][:width] + [0] * (width - len(tables[s][:width]))
                           for s in seqs], dev)                                       # [B, MB]
        return Paged(lk, None, to_device(blocks, dev), to_device(offsets, dev),
                     (to_device(items, dev), to_device(cols, dev)), table)

    def write(self, layer: int, paged: Paged, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new keys and values, k and v [B, Lq, KVH, hd]."""
        if paged.run is not None:
            keys, values, start = paged.run
            keys[layer, start:start + k.shape[1]] = k[0]
            values[layer, start:start + k.shape[1]] = v[0]
            return
        ck, cv = self.k[layer], self.v[layer]                                       # [NB, BS, KVH, hd]
        if paged.slots is not None:  # every token, padding to the scratch block
            write = write_slots if torch.compiler.is_compiling() else _write_slots
            write(self.k, layer, paged.slots, k.flatten(0, 1))
            write(self.v, layer, paged.slots, v.flatten(0, 1))
            return
        vb, vi = paged.rows
        ck[paged.write_block, paged.write_offset] = k[vb, vi]
        cv[paged.write_block, paged.write_offset] = v[vb, vi]

    def read(self, layer: int, paged: Paged) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of every item's first ``lk`` positions, [B, KVH, Lk, hd] each."""
        if paged.run is not None:
            keys = paged.run[0][layer, None, :paged.lk]                               # [1, Lk, KVH, hd]
            values = paged.run[1][layer, None, :paged.lk]
        else:
            keys = self.k[layer][paged.table].flatten(1, 2)[:, :paged.lk]             # [B, Lk, KVH, hd]
            values = self.v[layer][paged.table].flatten(1, 2)[:, :paged.lk]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def compact(self, seq: int, positions: list[int], start: int) -> None:
        """Copy the entries at ``positions`` to ``start, start + 1, ...`` (all layers)."""
        if not positions or positions == list(range(start, start + len(positions))):
            return
        bs, table = self.block_size, self.blocks.tables[seq]
        dst = range(start, start + len(positions))
        sb = to_device([table[p // bs] for p in positions], self.device)
        so = to_device([p % bs for p in positions], self.device)
        db = to_device([table[p // bs] for p in dst], self.device)
        do = to_device([p % bs for p in dst], self.device)
        self.k[:, db, do] = self.k[:, sb, so]
        self.v[:, db, do] = self.v[:, sb, so]
