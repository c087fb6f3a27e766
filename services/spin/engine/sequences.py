"""Per-request state of one model: the request's context (the one copy this model keeps), its KV
cache sequence and its random generator.

A caller updates a request's context by ``(keep, delta)``: the first ``keep`` tokens still hold and
``delta`` follows them (the router sends each service only what changed; the in-process engine
does the same). The cache keeps its entries up to the longest prefix still valid, found by
comparing only the tokens after ``keep`` (at most the last step's tokens): no step re-reads a whole
context. A request with nothing computed (new, or evicted) starts from the blocks the prefix cache
holds for its context (``BlockManager.match``); each update registers the request's newly full
context blocks there (``publish``), and so does its release. A model drafter's cache may also hold the chain it drafted past the context; the tokens
of it that the next context confirms are kept.

Each request has a generator; a seeded request's is re-seeded at every step from its seed, a
per-model offset (drafter and verifier draw independent streams) and its context length
(``generator``): a step that is dropped and redone (its cache preempted when blocks ran out, or a
draft the verifier never saw) draws the same numbers again, so a seeded request's tokens do not
depend on memory pressure.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache
from .sampling import seeded_generator


@dataclass
class Sequence:
    """One request on one model."""

    request_id: str
    seq: int
    """The cache's sequence id (its block table)."""
    generator: torch.Generator
    """The request's random stream on this model."""
    admitted: int
    """Admission order on this model (the youngest is preempted first)."""
    context: list[int] = field(default_factory=list)
    """The request's tokens: prompt and output so far."""
    drafted: list[int] = field(default_factory=list)
    """Tokens the cache holds past the context (a model drafter's chain)."""
    last_used: int = 0
    """Step counter of the last batch that used it (least recently used is evicted first)."""
    seed: int | None = None
    """The request's seed (None: its generator was seeded from the OS)."""


def step_seed(seed: int, position: int) -> int:
    """A 64-bit seed from two integers (splitmix64's finaliser over their combination)."""
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


class Sequences:
    """request id -> ``Sequence`` over one model's ``KVCache``."""

    def __init__(self, cache: KVCache, seed_offset: int = 0) -> None:
        self.cache = cache
        self.seed_offset = seed_offset
        self._seqs: dict[str, Sequence] = {}
        self._order = itertools.count()
        self.clock = 0
        """Batches seen (``last_used`` values)."""

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, request_id: str) -> Sequence:
        return self._seqs[request_id]

    def __iter__(self):
        return iter(self._seqs.values())

    def holds(self, request_id: str, keep: int) -> bool:
        """Whether ``keep`` tokens of the request's context are here (False: the caller resyncs)."""
        s = self._seqs.get(request_id)
        return keep == 0 if s is None else 0 <= keep <= len(s.context)

    def held(self, request_id: str) -> int:
        """Context tokens held for the request (0 for an unknown one): the next ``keep``."""
        s = self._seqs.get(request_id)
        return 0 if s is None else len(s.context)

    def apply(self, request_id: str, keep: int, delta: tuple[int, ...] | list[int],
              seed: int | None = None) -> Sequence:
        """Update (or admit: ``CacheFull`` when no sequence id is free) the request's context to
        ``context[:keep] + delta`` and roll its cache back to the longest prefix still valid,
        leaving at least the last context token to feed (its logits are what the next step
        needs). ``ValueError`` when ``keep`` tokens are not held (``holds``)."""
        s = self._seqs.get(request_id)
        if not self.holds(request_id, keep):
            raise ValueError(f"{request_id}: keep={keep} but {self.held(request_id)} tokens are "
                             f"held")
        if keep + len(delta) == 0:
            raise ValueError(f"{request_id}: the context is empty")
        if s is None:
            s = Sequence(request_id, self.cache.blocks.admit(request_id), seeded_generator(
                None if seed is None else seed + self.seed_offset, self.cache.device),
                next(self._order), seed=seed)
            self._seqs[request_id] = s
        length = self.cache.lengths[s.seq]
        valid = length
        if length > keep:  # the cache holds tokens past `keep`: those that `delta` repeats stay
            held = s.context[keep:length] + s.drafted[:max(0, length - len(s.context))]
            same = 0
            for a, b in zip(held, delta):
                if a != b:
                    break
                same += 1
            valid = keep + same
        del s.context[keep:]
        s.context.extend(delta)
        s.drafted = []
        if length == 0:  # nothing computed (new, or evicted): what the prefix cache holds
            self.cache.blocks.match(s.seq, s.context)
        else:
            self.cache.rollback(s.seq, min(valid, len(s.context) - 1))
            self.cache.blocks.publish(s.seq, s.context)
        s.last_used = self.clock
        return s

    def generator(self, s: Sequence) -> torch.Generator:
        """The request's generator for a step at its current context length: a seeded request's
        is re-seeded from (seed, this model's offset, context length), so a step that is
        dropped and redone (a preempted verification, a draft the verifier never saw) draws
        the same numbers the second time, and the request's tokens do not depend on it."""
        if s.seed is not None:
            s.generator.manual_seed(step_seed(s.seed + self.seed_offset, len(s.context)))
        return s.generator

    def feed(self, s: Sequence) -> list[int]:
        """The context tokens the cache lacks (at least the last one)."""
        return s.context[self.cache.lengths[s.seq]:]

    def extend(self, request_id: str, tokens: list[int] | tuple[int, ...]) -> None:
        """Append tokens this model decided itself (the verifier's emitted tokens)."""
        self._seqs[request_id].context.extend(tokens)

    def evict(self, request_id: str) -> None:
        """Drop the request's cache (its blocks go back), keeping its context and generator:
        the next step recomputes the cache."""
        s = self._seqs[request_id]
        self.cache.blocks.evict(s.seq)
        s.drafted = []

    def release(self, request_id: str) -> None:
        """Forget the request and free its cache; unknown ids are ignored (idempotent)."""
        s = self._seqs.pop(request_id, None)
        if s is not None:
            self.cache.blocks.publish(s.seq, s.context)  # kept for later requests
            self.cache.blocks.free(s.seq)

    def tick(self) -> int:
        """A new batch: advance the clock that ``last_used`` reads."""
        self.clock += 1
        return self.clock
