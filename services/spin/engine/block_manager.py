"""Fixed-size KV cache blocks: a free pool, and a block table and a length per sequence.

A model's KV cache is a pool of ``num_blocks`` blocks of ``block_size`` token positions each
(nano-vllm's block manager, vLLM's PagedAttention). A sequence (one request on one model) owns the
blocks its block table lists: position ``p`` of the sequence lives at offset ``p % block_size`` of
block ``table[p // block_size]``. Blocks are taken as a sequence grows (``reserve``), and given back
when it rolls back past a block boundary (``commit``), is evicted (``evict``: its cache is dropped
and will be recomputed) or finishes (``free``). Nothing here is sized by a model's context: a
sequence holds the blocks of the tokens it has.

A growing sequence takes the block after its last one when that block is free, so a sequence that
grows alone lies in one contiguous run and the model reads its keys and values without gathering
(``contiguous``).
"""

from __future__ import annotations

import heapq


class CacheFull(RuntimeError):
    """No free sequence id or not enough free blocks (the caller preempts, evicts or refuses)."""


class BlockManager:
    """Blocks and block tables of up to ``max_seqs`` sequences (no tensors: the bookkeeping)."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int) -> None:
        if num_blocks <= 0 or block_size <= 0 or max_seqs <= 0:
            raise ValueError(f"num_blocks ({num_blocks}), block_size ({block_size}) and max_seqs "
                             f"({max_seqs}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lengths: list[int] = [0] * max_seqs
        """Committed tokens of each sequence id."""
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]
        """Block ids of each sequence id, in position order."""
        self._is_free = bytearray(b"\x01") * num_blocks
        self._free_heap = list(range(num_blocks))  # lazy: entries of taken blocks are skipped
        self._num_free = num_blocks
        self._free_seqs: list[int] = list(range(max_seqs - 1, -1, -1))
        self._owner: dict[int, str] = {}

    # ---- sizes -----------------------------------------------------------------------------------
    @property
    def max_seqs(self) -> int:
        return len(self.lengths)

    @property
    def free_blocks(self) -> int:
        return self._num_free

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def free_seqs(self) -> int:
        return len(self._free_seqs)

    @property
    def capacity_tokens(self) -> int:
        """Token positions of the whole pool."""
        return self.num_blocks * self.block_size

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold ``tokens`` positions."""
        return -(-tokens // self.block_size)

    def needed(self, seq: int, tokens: int) -> int:
        """More blocks sequence ``seq`` needs to hold ``tokens`` positions (0 if it has them)."""
        return max(0, self.blocks_for(tokens) - len(self.tables[seq]))

    # ---- sequences -------------------------------------------------------------------------------
    def owner(self, seq: int) -> str | None:
        return self._owner.get(seq)

    def admit(self, owner: str) -> int:
        """A free sequence id for ``owner``, empty (no blocks, length 0)."""
        if not self._free_seqs:
            raise CacheFull(f"all {self.max_seqs} sequences are in use")
        seq = self._free_seqs.pop()
        self._owner[seq] = owner
        self.lengths[seq] = 0
        return seq

    def free(self, seq: int) -> None:
        """Give a sequence id and its blocks back. Freeing twice is an error."""
        self._check(seq)
        self.evict(seq)
        del self._owner[seq]
        self._free_seqs.append(seq)

    def evict(self, seq: int) -> None:
        """Drop the sequence's cache (all its blocks; length 0); the id stays its owner's."""
        self._check(seq)
        self._release(self.tables[seq])
        self.tables[seq] = []
        self.lengths[seq] = 0

    def _check(self, seq: int) -> None:
        if seq not in self._owner:
            raise KeyError(f"sequence {seq} is not in use")

    # ---- blocks ----------------------------------------------------------------------------------
    def reserve(self, seq: int, tokens: int) -> list[int]:
        """Make sequence ``seq`` hold blocks for ``tokens`` positions and return the blocks it
        took (``CacheFull``, taking nothing, when the pool has too few free blocks)."""
        self._check(seq)
        need = self.needed(seq, tokens)
        if need > self._num_free:
            raise CacheFull(f"sequence {seq} needs {need} more blocks, {self._num_free} are free")
        table = self.tables[seq]
        for _ in range(need):
            nxt = table[-1] + 1 if table else -1
            table.append(nxt if 0 <= nxt < self.num_blocks and self._is_free[nxt]
                         else self._pop_free())
            self._is_free[table[-1]] = 0
        self._num_free -= need
        return table[len(table) - need:]

    def _pop_free(self) -> int:
        while True:
            block = heapq.heappop(self._free_heap)
            if self._is_free[block]:
                return block

    def _release(self, blocks: list[int]) -> None:
        for block in blocks:
            self._is_free[block] = 1
            heapq.heappush(self._free_heap, block)
        self._num_free += len(blocks)
        if len(self._free_heap) > 2 * self.num_blocks:  # drop the entries of taken blocks
            self._free_heap = [b for b in range(self.num_blocks) if self._is_free[b]]

    def commit(self, seq: int, length: int) -> None:
        """Set the committed length (after a forward wrote up to it, or to roll back) and give
        back the blocks past it."""
        self._check(seq)
        if not 0 <= length <= len(self.tables[seq]) * self.block_size:
            raise ValueError(f"length {length} outside 0..{len(self.tables[seq]) * self.block_size}"
                             f" (the blocks sequence {seq} holds)")
        self.lengths[seq] = length
        keep = self.blocks_for(length)
        if len(self.tables[seq]) > keep:
            self._release(self.tables[seq][keep:])
            del self.tables[seq][keep:]

    def rollback(self, seq: int, length: int) -> None:
        """Forget everything after the first ``length`` committed tokens."""
        self._check(seq)
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot roll sequence {seq} back to {length}: it holds "
                             f"{self.lengths[seq]} tokens")
        self.commit(seq, length)

    def contiguous(self, seq: int) -> int | None:
        """The first block when the sequence's blocks are one ascending run, else None."""
        table = self.tables[seq]
        if table and all(b - a == 1 for a, b in zip(table, table[1:])):
            return table[0]
        return None
