"""Keys and values of every layer, in per-request slots that can roll back to any length.

Layout per layer: [slots, kv_heads, max_len, head_dim]. A request owns one slot from admission to
free. ``lengths[slot]`` is the committed context length; a forward may write entries past it (the
drafted tokens being scored) and the caller then commits the accepted ones or rolls back. Tree
verification accepts a path whose nodes need not be contiguous: ``compact`` moves their entries
into place before committing.
"""

from __future__ import annotations

import torch

from .sampling import seeded_generator


class CacheFull(RuntimeError):
    """No free slot (the caller maps this to RESOURCE_EXHAUSTED)."""


class KVCache:
    """Per-request key/value slots for ``num_layers`` layers."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (num_layers, num_slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len = max_len
        self.lengths: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_slots(self) -> int:
        return len(self.lengths)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def owner(self, slot: int) -> str | None:
        return self._owner.get(slot)

    def admit(self, request_id: str) -> int:
        """A free slot for ``request_id``, empty (length 0)."""
        if not self._free:
            raise CacheFull(f"all {self.num_slots} cache slots are in use")
        slot = self._free.pop()
        self._owner[slot] = request_id
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Give a slot back (finished or cancelled request). Freeing twice is an error."""
        if slot not in self._owner:
            raise KeyError(f"slot {slot} is not in use")
        del self._owner[slot]
        self.lengths[slot] = 0
        self._free.append(slot)

    def _check(self, slot: int) -> None:
        if slot not in self._owner:
            raise KeyError(f"slot {slot} is not in use")

    def commit(self, slot: int, length: int) -> None:
        """Set the committed length after a forward wrote entries up to ``length``."""
        self._check(slot)
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} outside 0..{self.max_len}")
        self.lengths[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""
        self._check(slot)
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll slot {slot} back to {length}: it holds "
                             f"{self.lengths[slot]} tokens")
        self.lengths[slot] = length

    def compact(self, slot: int, positions: list[int], start: int) -> None:
        """Copy the entries at ``positions`` to ``start, start + 1, ...`` (all layers)."""
        self._check(slot)
        if not positions or positions == list(range(start, start + len(positions))):
            return
        src = torch.tensor(positions, device=self.k.device)
        dst = slice(start, start + len(positions))
        self.k[:, slot, :, dst] = self.k[:, slot, :, src]
        self.v[:, slot, :, dst] = self.v[:, slot, :, src]


class RequestSlots:
    """Per-request state of one model: its cache slot, the tokens that slot holds keys and values
    for, and the request's random generator on this model (seeded from the request's seed plus a
    per-model offset, so drafter and verifier draw independent streams)."""

    def __init__(self, cache: KVCache, seed_offset: int = 0) -> None:
        self.cache = cache
        self.seed_offset = seed_offset
        self._slot: dict[str, int] = {}
        self._tokens: dict[str, list[int]] = {}
        self._gens: dict[str, torch.Generator] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def slot(self, request_id: str) -> int:
        return self._slot[request_id]

    def generator(self, request_id: str) -> torch.Generator:
        return self._gens[request_id]

    def sync(self, request_id: str, context: tuple[int, ...] | list[int],
             seed: int | None = None) -> tuple[int, int]:
        """Make the slot hold a prefix of ``context``; return (slot, length of that prefix).

        A new request is admitted (``CacheFull`` when none is free) and gets its generator,
        seeded from ``seed`` (None: from the OS). The prefix is the longest one
        shared with what the slot holds, and always leaves at least the last context token to feed
        (its logits are what the next step needs). The caller feeds ``context[prefix:]``.
        """
        if request_id not in self._slot:
            self._slot[request_id] = self.cache.admit(request_id)
            self._tokens[request_id] = []
            self._gens[request_id] = seeded_generator(
                None if seed is None else seed + self.seed_offset, self.cache.k.device)
        slot, held = self._slot[request_id], self._tokens[request_id]
        limit = min(len(held), len(context) - 1, self.cache.lengths[slot])
        common = limit if held[:limit] == list(context[:limit]) else 0  # the usual case, at C speed
        while common < limit and held[common] == context[common]:
            common += 1
        self.cache.rollback(slot, common)
        return slot, common

    def held(self, request_id: str) -> int:
        """How many tokens the request's slot holds (0 for an unknown request)."""
        return len(self._tokens.get(request_id, ()))

    def hold(self, request_id: str, tokens: list[int]) -> None:
        """Record the tokens the slot now holds (after the caller committed them)."""
        self._tokens[request_id] = tokens

    def release(self, request_id: str) -> None:
        """Free the request's slot; unknown ids are ignored (release is idempotent)."""
        slot = self._slot.pop(request_id, None)
        self._tokens.pop(request_id, None)
        self._gens.pop(request_id, None)
        if slot is not None:
            self.cache.free(slot)
