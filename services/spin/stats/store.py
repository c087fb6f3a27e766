"""Acceptance statistics per drafter, collected off the decoding path.

The router calls ``store.record(drafter, k, accepted, draft_s, verify_s, rejected)`` after every
verification step for every request that speculated. ``record`` is O(1) and never blocks on I/O
or raises: it adds to an in-process pending aggregate under a lock (histograms of ``k`` and
``accepted``; the per-position counts are derived from them when read or flushed).

``RedisStatsStore`` (``redis_store.py``) writes it to Redis, shared by router replicas;
``MemoryStatsStore`` keeps it in process.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "spin:acceptance"
RESERVED_DRAFTER_NAMES = frozenset({"drafters"})
"""Names that would collide with ``{prefix}:drafters``; drafters starting with ``_`` are refused too."""
_INT_FIELDS = ("drafts", "draft_tokens", "accepted_tokens", "rejections")
_FLOAT_FIELDS = ("draft_seconds", "verify_seconds")
_ACCEPTED_POS, _DRAFTED_POS = "accepted_pos:", "drafted_pos:"
@dataclass
class DrafterStats:
    """Acceptance statistics of one drafter (positions are 1-based draft positions)."""

    drafts: int = 0
    """Verification steps in which the drafter proposed tokens for a request."""
    draft_tokens: int = 0
    """Sum of k: draft tokens (tree nodes) proposed."""
    accepted_tokens: int = 0
    """Sum of accepted draft tokens (the bonus token of the target is not counted)."""
    rejections: int = 0
    """Steps whose draft the target rejected before its end (a chain stops at its first
    rejection; a step that accepted its whole chain has none)."""
    accepted_per_pos: dict[int, int] = field(default_factory=dict)
    """Position i -> steps in which position i was accepted (accepted >= i), i = 1..k_max."""
    drafted_per_pos: dict[int, int] = field(default_factory=dict)
    """Position i -> steps whose draft had a position i (k >= i), i = 1..k_max."""
    draft_seconds: float = 0.0
    """Sum of the drafting time of the steps."""
    verify_seconds: float = 0.0
    """Sum of the verification time of the steps."""

    @property
    def acceptance_rate(self) -> float:
        """accepted_tokens / draft_tokens (0.0 before any draft token)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def chain_acceptance(self) -> float:
        """The per-token acceptance a chain's length follows: accepted_tokens / (accepted_tokens
        + rejections), the truncated-geometric estimate the policy predicts with
        (``policy/acceptance.py``). ``acceptance_rate`` counts a chain's tokens after its first
        rejection as rejected too, though the target never judged them: for the demo's EAGLE
        head at k = 4 on sampled prompts it is 0.46 where this is 0.71, and 0.71 predicts the
        2.81 tokens a step measured (1 + 0.71 + ... + 0.71^4 = 2.83). Records from before
        rejections were counted (none while tokens were rejected) give ``acceptance_rate``."""
        if self.rejections == 0 and self.accepted_tokens < self.draft_tokens:
            return self.acceptance_rate
        seen = self.accepted_tokens + self.rejections
        return self.accepted_tokens / seen if seen else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted_tokens / drafts: tokens emitted per step, INCLUDING the bonus token.

        vLLM's "mean acceptance length" definition; 0.0 before any draft.
        """
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 0.0

    def acceptance_at(self, pos: int) -> float:
        """accepted_per_pos[pos] / drafted_per_pos[pos] (0.0 when no draft reached ``pos``)."""
        drafted = self.drafted_per_pos.get(pos, 0)
        return self.accepted_per_pos.get(pos, 0) / drafted if drafted else 0.0

    def merge(self, other: DrafterStats) -> DrafterStats:
        """Add ``other`` into this object (in place) and return it."""
        _add_fields(self, other, _INT_FIELDS + _FLOAT_FIELDS)
        _add_counts(self.accepted_per_pos, other.accepted_per_pos)
        _add_counts(self.drafted_per_pos, other.drafted_per_pos)
        self._normalize()
        return self

    def copy(self) -> DrafterStats:
        """An independent copy."""
        return DrafterStats().merge(self)

    def _normalize(self) -> None:
        for pos in self.drafted_per_pos:
            self.accepted_per_pos.setdefault(pos, 0)


@dataclass
class _Tally:
    """Pending increments of one drafter: histograms keep ``add`` O(1)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    rejections: int = 0
    k_counts: dict[int, int] = field(default_factory=dict)
    accepted_counts: dict[int, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, k: int, accepted: int, rejected: bool, draft_s: float, verify_s: float) -> None:
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
        self.rejections += rejected
        self.k_counts[k] = self.k_counts.get(k, 0) + 1
        self.accepted_counts[accepted] = self.accepted_counts.get(accepted, 0) + 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s

    def absorb(self, other: _Tally) -> None:
        _add_fields(self, other, _INT_FIELDS + _FLOAT_FIELDS)
        _add_counts(self.k_counts, other.k_counts)
        _add_counts(self.accepted_counts, other.accepted_counts)

    def to_stats(self) -> DrafterStats:
        k_max = max(self.k_counts, default=0)
        return DrafterStats(
            drafts=self.drafts,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            rejections=self.rejections,
            accepted_per_pos={i: _at_least(self.accepted_counts, i) for i in range(1, k_max + 1)},
            drafted_per_pos={i: _at_least(self.k_counts, i) for i in range(1, k_max + 1)},
            draft_seconds=self.draft_seconds,
            verify_seconds=self.verify_seconds,
        )


def _at_least(hist: dict[int, int], i: int) -> int:
    return sum(n for value, n in hist.items() if value >= i)


def _add_counts(dst: dict[int, int], src: dict[int, int]) -> None:
    for key, n in src.items():
        dst[key] = dst.get(key, 0) + n


def _add_fields(dst: object, src: object, names: tuple[str, ...]) -> None:
    for name in names:
        setattr(dst, name, getattr(dst, name) + getattr(src, name))


Tallies = dict[str, _Tally]
Population = dict[str, DrafterStats]


def _absorb_all(dst: Tallies, src: Tallies) -> None:
    for name, tally in src.items():
        dst.setdefault(name, _Tally()).absorb(tally)


def _merge_into(dst: Population, src: Population) -> Population:
    for name, stats in src.items():
        dst.setdefault(name, DrafterStats()).merge(stats)
    return dst


def _to_population(tallies: Tallies) -> Population:
    return {name: tally.to_stats() for name, tally in tallies.items()}


@runtime_checkable
class StatsStore(Protocol):
    """Where the router records acceptance statistics; see the module docstring."""

    def record(self, drafter: str, k: int, accepted: int, draft_s: float, verify_s: float,
               rejected: bool | None = None) -> None:
        """Count one verification step of one request: ``k`` draft tokens (tree nodes),
        ``accepted`` of them, ``rejected``: the target rejected the draft before its end (None:
        ``accepted < k``, a chain's rule). O(1), never blocks on I/O, never raises."""
        ...

    def population(self) -> dict[str, DrafterStats]:
        """The statistics of the whole population (shared store plus what is pending here)."""
        ...

    def flush(self) -> bool:
        """Write the pending increments now; False when that failed (they stay pending)."""
        ...

    def close(self) -> None:
        """Final flush attempt and release of resources; idempotent."""
        ...


class _TallyingStore:
    """The local half shared by the stores: validated, O(1) ``record`` into a pending aggregate."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Tallies = {}
        self._warned: set[str] = set()

    def record(self, drafter: str, k: int, accepted: int, draft_s: float, verify_s: float,
               rejected: bool | None = None) -> None:
        """Count one verification step (``StatsStore.record``); bad arguments are logged (once
        per kind) and clamped/dropped."""
        try:
            name, k, accepted = str(drafter), int(k), int(accepted)
            draft_s, verify_s = float(draft_s), float(verify_s)
            if not name or name in RESERVED_DRAFTER_NAMES or name.startswith("_") or k < 0:
                self._warn_once(f"drop:{name}", "dropping step of drafter %r (k=%d)", name, k)
                return
            if not 0 <= accepted <= k:
                msg = "drafter %r: accepted=%d clamped to 0..%d"
                self._warn_once(f"clamp:{name}", msg, name, accepted, k)
                accepted = min(max(accepted, 0), k)
            draft_s = draft_s if math.isfinite(draft_s) and draft_s > 0.0 else 0.0
            verify_s = verify_s if math.isfinite(verify_s) and verify_s > 0.0 else 0.0
            with self._lock:
                tally = self._pending.get(name)
                if tally is None:
                    tally = self._pending[name] = _Tally()
                tally.add(k, accepted, accepted < k if rejected is None else bool(rejected),
                          draft_s, verify_s)
        except Exception:  # never let statistics break decoding
            self._warn_once("error", "stats record(%r, %r, %r) failed", drafter, k, accepted, exc_info=True)

    def _warn_once(self, key: str, msg: str, *args: object, exc_info: bool = False) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args, exc_info=exc_info)

    def pending_steps(self) -> int:
        """Steps recorded here and not yet written to the shared store."""
        with self._lock:
            return sum(t.drafts for tallies in self._unwritten() for t in tallies.values())

    def _unwritten(self) -> tuple[Tallies, ...]:
        return (self._pending,)


class MemoryStatsStore(_TallyingStore):
    """Everything in process (no Redis): the population is what this process recorded."""

    def population(self) -> dict[str, DrafterStats]:
        """What this process recorded."""
        with self._lock:
            return _to_population(self._pending)

    def flush(self) -> bool:
        """Nothing to write: always True."""
        return True

    def close(self) -> None:
        """Nothing to release."""

