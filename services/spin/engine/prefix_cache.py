"""The prefix cache of one model's block pool: full KV blocks found again by their tokens.

A full block (``block_size`` context tokens, all committed) is keyed by a hash chained over the
tokens of every block before it and its own (vLLM's automatic prefix caching; the model is
implied: each model has its own pool). A request whose context starts with the tokens of
registered blocks attaches those blocks instead of computing them (``BlockManager.match``), and
a block is shared by reference count. When no sequence holds a registered block any more it
stays where it is, *idle*, with its keys and values, and is handed out again only when the pool
has no never-registered free block left, the least recently released first
(``BlockManager._take``). Idle blocks count as free: the cache never costs a request a block.

Lookups compare the tokens themselves, not only the hash (a collision is a miss, never a wrong
hit): a hit changes no output. A registered block is never written: the block manager keeps
every write of a sequence past its registered blocks, and a rollback into one either stops
using it (``forget``: its last holder) or leaves it to the others (the sequence recomputes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

Key = int
"""A block's chained hash: ``hash((parent key, tokens))`` (deterministic for ints)."""


@dataclass(frozen=True)
class _Entry:
    parent: Key | None
    """The key of the block before it (None: the first block of a context)."""
    tokens: tuple[int, ...]
    """The tokens whose keys and values it holds."""
    key: Key


class PrefixCache:
    """Registered blocks by key, and the idle ones in least-recently-released order."""

    def __init__(self) -> None:
        self._by_key: dict[Key, int] = {}
        self._entries: dict[int, _Entry] = {}
        """block -> what it holds (registered blocks only)."""
        self._idle: OrderedDict[int, int] = OrderedDict()
        """Registered blocks no sequence holds -> when released (a count of releases), least
        recently released first."""
        self._releases = 0
        self.queries = 0
        """Context tokens looked up (``spin:prefix_cache_queries_total``)."""
        self.hits = 0
        """Of those, tokens found in registered blocks (``spin:prefix_cache_hits_total``)."""

    @staticmethod
    def key(parent: Key | None, tokens: tuple[int, ...]) -> Key:
        return hash((parent, tokens))

    def __len__(self) -> int:
        """Registered blocks (held and idle)."""
        return len(self._entries)

    @property
    def idle(self) -> int:
        """Registered blocks no sequence holds (free for the pool, kept until needed)."""
        return len(self._idle)

    def registered(self, block: int) -> bool:
        return block in self._entries

    def lookup(self, parent: Key | None, tokens: tuple[int, ...]) -> tuple[int, Key] | None:
        """The block registered for ``tokens`` after ``parent``, and its key; None: a miss."""
        key = self.key(parent, tokens)
        block = self._by_key.get(key)
        if block is None:
            return None
        e = self._entries[block]
        return (block, key) if e.parent == parent and e.tokens == tokens else None

    def register(self, block: int, parent: Key | None, tokens: tuple[int, ...]) -> Key:
        """Register ``block`` as holding ``tokens`` after ``parent`` (unless another block
        already holds them, or it is registered) and return their key."""
        key = self.key(parent, tokens)
        if key not in self._by_key and block not in self._entries:
            self._by_key[key] = block
            self._entries[block] = _Entry(parent, tokens, key)
        return key

    def forget(self, block: int) -> None:
        """Unregister ``block`` (its contents are about to change)."""
        e = self._entries.pop(block, None)
        if e is not None:
            del self._by_key[e.key]
            self._idle.pop(block, None)

    def release(self, block: int) -> bool:
        """The last holder let ``block`` go: True when it stays idle (registered)."""
        if block in self._entries:
            self._idle[block] = self._releases
            self._releases += 1
            return True
        return False

    def old(self, block: int) -> bool:
        """``block`` is idle and was released before the midpoint of the idle blocks' releases
        (a growing run may take it without dropping what was cached recently)."""
        stamp = self._idle.get(block)
        if stamp is None:
            return False
        oldest = next(iter(self._idle.values()))
        return stamp <= (oldest + self._releases) / 2

    def hold(self, block: int) -> None:
        """An idle block is attached again."""
        self._idle.pop(block, None)

    def evict(self) -> int | None:
        """The least recently released idle block, unregistered (None: there is none)."""
        if not self._idle:
            return None
        block, _ = self._idle.popitem(last=False)
        self.forget(block)
        return block
