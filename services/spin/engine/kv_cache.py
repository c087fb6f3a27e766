"""Keys and values of every layer, in per-request slots that can roll back to any length.

Layout per layer: [slots, kv_heads, max_len, head_dim]. A request owns one slot from admission to
free. ``lengths[slot]`` is the committed context length; a forward may write entries past it (the
drafted tokens being scored) and the caller then commits the accepted ones or rolls back. Tree
verification accepts a path whose nodes need not be contiguous: ``compact`` moves their entries
into place before committing.
"""

from __future__ import annotations

import torch


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
