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

With ``prefix_caching`` (``prefix_cache.py``), the full blocks of a sequence's context are
registered by their tokens (``publish``), blocks are shared by reference count, a new sequence
attaches the registered blocks its context starts with (``match``), and a released registered
block stays idle with its contents until a block is needed and no other is free.
"""

from __future__ import annotations

import heapq

from .prefix_cache import Key, PrefixCache


class CacheFull(RuntimeError):
    """No free sequence id or not enough free blocks (the caller preempts, evicts or refuses)."""


class BlockManager:
    """Blocks and block tables of up to ``max_seqs`` sequences (no tensors: the bookkeeping)."""

    def __init__(self, num_blocks: int, block_size: int, max_seqs: int,
                 prefix_caching: bool = False) -> None:
        if num_blocks <= 0 or block_size <= 0 or max_seqs <= 0:
            raise ValueError(f"num_blocks ({num_blocks}), block_size ({block_size}) and max_seqs "
                             f"({max_seqs}) must be > 0")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.lengths: list[int] = [0] * max_seqs
        """Committed tokens of each sequence id."""
        self.tables: list[list[int]] = [[] for _ in range(max_seqs)]
        """Block ids of each sequence id, in position order."""
        self._refs = [0] * num_blocks
        """Sequences holding each block (0: free, or idle in the prefix cache)."""
        self._free_heap = list(range(num_blocks))  # lazy: entries of taken blocks are skipped
        self._num_free = num_blocks
        """Blocks no sequence holds (idle prefix-cache blocks included)."""
        self._free_seqs: list[int] = list(range(max_seqs - 1, -1, -1))
        self._owner: dict[int, str] = {}
        self.prefix: PrefixCache | None = PrefixCache() if prefix_caching else None
        """The prefix cache (None: prefix caching off)."""
        self._keys: list[list[Key]] = [[] for _ in range(max_seqs)]
        """Chained keys of each sequence's leading full context blocks (``publish``)."""

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
        self._keys[seq] = []

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
            nxt = self._next_free(table[-1] + 1) if table else None
            table.append(nxt if nxt is not None else self._take())
            self._refs[table[-1]] = 1
        self._num_free -= need
        return table[len(table) - need:]

    def _next_free(self, block: int) -> int | None:
        """``block`` for a run that grows into it (contiguous keys are read as a view), when it
        is free and holds nothing cached, or, once every free block is idle in the prefix
        cache, when it is among the older half of those (its contents dropped); else None."""
        if not 0 <= block < self.num_blocks or self._refs[block]:
            return None
        if self._unused(block):
            return block
        while self._free_heap and not self._unused(self._free_heap[0]):
            heapq.heappop(self._free_heap)  # taken or cached since it was pushed
        if self._free_heap or not self.prefix.old(block):
            return None
        self.prefix.forget(block)
        return block

    def _unused(self, block: int) -> bool:
        """Free and holding nothing the prefix cache keeps."""
        return self._refs[block] == 0 and (self.prefix is None
                                           or not self.prefix.registered(block))

    def _take(self) -> int:
        """A free block: one that holds nothing, else the least recently released idle one."""
        while self._free_heap:
            block = heapq.heappop(self._free_heap)
            if self._unused(block):
                return block
        block = self.prefix.evict() if self.prefix is not None else None
        if block is None:  # the caller checked the free count: a bookkeeping error
            raise RuntimeError("the free-block count and the free blocks disagree")
        return block

    def _release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block's last release frees it (idle in the
        prefix cache when registered: a sequence's last blocks become idle first, so that its
        first blocks, the ones other contexts share, are evicted last)."""
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            self._num_free += 1
            if self.prefix is None or not self.prefix.release(block):
                heapq.heappush(self._free_heap, block)
        if len(self._free_heap) > 2 * self.num_blocks:  # drop the entries of taken blocks
            self._free_heap = [b for b in range(self.num_blocks) if self._unused(b)]

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
        if self.prefix is not None:
            self._unshare_tail(seq)

    def _unshare_tail(self, seq: int) -> None:
        """Keep the sequence's next writes out of registered blocks: a partly kept last block
        that is registered is unregistered when this sequence alone holds it, else dropped from
        its table (the length falls to the block's start: the caller recomputes the rest)."""
        full = self.lengths[seq] // self.block_size
        del self._keys[seq][full:]
        table = self.tables[seq]
        if len(table) > full and self.prefix.registered(table[full]):
            if self._refs[table[full]] == 1:
                self.prefix.forget(table[full])
            else:
                self._release(table[full:])
                del table[full:]
                self.lengths[seq] = full * self.block_size

    def rollback(self, seq: int, length: int) -> None:
        """Forget everything after the first ``length`` committed tokens."""
        self._check(seq)
        if not 0 <= length <= self.lengths[seq]:
            raise ValueError(f"cannot roll sequence {seq} back to {length}: it holds "
                             f"{self.lengths[seq]} tokens")
        self.commit(seq, length)

    # ---- prefix caching --------------------------------------------------------------------------
    def match(self, seq: int, context: list[int]) -> int:
        """Attach to an empty sequence the registered blocks its ``context`` starts with (all
        but its last token: the next forward must feed at least that one) and return the
        tokens they hold (0 without prefix caching)."""
        if self.prefix is None or self.tables[seq] or not context:
            return 0
        bs, keys, table = self.block_size, self._keys[seq], self.tables[seq]
        parent = None
        for i in range((len(context) - 1) // bs):
            found = self.prefix.lookup(parent, tuple(context[i * bs:(i + 1) * bs]))
            if found is None:
                break
            block, parent = found
            if self._refs[block] == 0:
                self.prefix.hold(block)
                self._num_free -= 1
            self._refs[block] += 1
            table.append(block)
            keys.append(parent)
        self.lengths[seq] = len(table) * bs
        self.prefix.queries += len(context)
        self.prefix.hits += self.lengths[seq]
        return self.lengths[seq]

    def publish(self, seq: int, context: list[int]) -> None:
        """Register the sequence's full blocks of committed ``context`` tokens not registered
        yet (a block whose tokens another block already holds stays this sequence's own)."""
        if self.prefix is None:
            return
        bs, keys, table = self.block_size, self._keys[seq], self.tables[seq]
        for i in range(len(keys), min(self.lengths[seq], len(context)) // bs):
            parent = keys[-1] if keys else None
            keys.append(self.prefix.register(table[i], parent,
                                             tuple(context[i * bs:(i + 1) * bs])))

    def contiguous(self, seq: int) -> int | None:
        """The first block when the sequence's blocks are one ascending run, else None."""
        table = self.tables[seq]
        if table and all(b - a == 1 for a, b in zip(table, table[1:])):
            return table[0]
        return None
