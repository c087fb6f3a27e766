"""Acceptance statistics per drafter, collected off the decoding path.

The router calls ``store.record(drafter, k, accepted, draft_s, verify_s)`` after every verification
step for every request that speculated. ``record`` is O(1) and never blocks on I/O or raises: it
adds to an in-process pending aggregate under a lock (histograms of ``k`` and ``accepted``; the
per-position counts are derived from them when read or flushed).

``RedisStatsStore`` flushes that aggregate from a daemon thread, every ``flush_interval_s``, as ONE
MULTI/EXEC transaction of HINCRBY/HINCRBYFLOAT on a hash per drafter (``{prefix}:{drafter}``, fields
``drafts``, ``draft_tokens``, ``accepted_tokens``, ``accepted_pos:{i}``, ``drafted_pos:{i}``,
``draft_seconds``, ``verify_seconds``) plus SADD of the drafter to ``{prefix}:drafters``. Router
replicas sharing one Redis add up, since they only increment.

Exactly once: a batch whose outcome is unknown (an error, maybe after EXEC ran) is kept with its
sequence number. The same transaction that applies a batch sets ``{prefix}:_applied:{store id}``
to that number, so the next attempt WATCHes that key, reads it, and either drops the batch (it was
applied) or merges the new increments into it and applies both. Redis down: nothing is lost,
``on_error`` is called, retries back off exponentially (capped at ~5 s) and catch up when it returns.
"""

from __future__ import annotations

import logging
import math
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger(__name__)

DEFAULT_KEY_PREFIX = "spin:acceptance"
RESERVED_DRAFTER_NAMES = frozenset({"drafters"})
"""Names that would collide with ``{prefix}:drafters``; drafters starting with ``_`` are refused too."""
_SEQ_TTL_S = 7 * 24 * 3600
_INT_FIELDS = ("drafts", "draft_tokens", "accepted_tokens")
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
    k_counts: dict[int, int] = field(default_factory=dict)
    accepted_counts: dict[int, int] = field(default_factory=dict)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def add(self, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        self.drafts += 1
        self.draft_tokens += k
        self.accepted_tokens += accepted
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

    def record(self, drafter: str, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Count one verification step of one request: O(1), never blocks on I/O, never raises."""
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

    def record(self, drafter: str, k: int, accepted: int, draft_s: float, verify_s: float) -> None:
        """Count one verification step; bad arguments are logged (once per kind) and clamped/dropped."""
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
                tally.add(k, accepted, draft_s, verify_s)
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


class RedisStatsStore(_TallyingStore):
    """Statistics shared through Redis, written by a daemon thread; see the module docstring."""

    def __init__(
        self,
        url: str,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        flush_interval_s: float = 0.5,
        on_error: Callable[[Exception], None] | None = None,
        on_flush: Callable[[int], None] | None = None,
        *,
        max_backoff_s: float = 5.0,
        socket_timeout_s: float = 0.5,
    ) -> None:
        """``on_error(exc)`` is called on every failed Redis operation (a metric hook);
        ``on_flush(steps)`` after every flush that wrote something, with the steps it wrote."""
        super().__init__()
        if flush_interval_s <= 0 or max_backoff_s <= 0:
            raise ValueError("flush_interval_s and max_backoff_s must be positive")
        self.key_prefix = key_prefix
        self.flush_interval_s = flush_interval_s
        self.max_backoff_s = max(max_backoff_s, flush_interval_s)
        self._on_error, self._on_flush = on_error, on_flush
        # No client-side retries: a retried EXEC could apply twice; our own loop retries safely.
        timeouts = {"socket_connect_timeout": socket_timeout_s, "socket_timeout": socket_timeout_s}
        self._client = redis.Redis.from_url(
            url, retry=Retry(NoBackoff(), 0), decode_responses=True, **timeouts
        )
        self._drafters_key = f"{key_prefix}:drafters"
        self._seq_key = f"{key_prefix}:_applied:{uuid.uuid4().hex}"
        self._io_lock = threading.Lock()  # one Redis conversation at a time (flush / population)
        self._batch: Tallies | None = None  # handed to Redis, outcome unknown
        self._batch_seq = 0
        self._snapshot: Population = {}  # last population read from Redis + batches applied since
        self._failing = False
        self._closed = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spin-stats-flush", daemon=True)
        self._thread.start()

    def hash_key(self, drafter: str) -> str:
        """The Redis hash of one drafter."""
        return f"{self.key_prefix}:{drafter}"

    def flush(self) -> bool:
        """One transaction with everything pending (and a batch of unknown outcome); False on error."""
        with self._io_lock:
            try:
                steps = self._flush_locked()
            except Exception as exc:  # any failure: the batch stays for the next attempt
                self._failed(exc)
                return False
            self._recovered()
        if steps:
            self._call_hook(self._on_flush, steps)
        return True

    def _flush_locked(self) -> int:
        with self._lock:
            if self._batch is None and not self._pending:
                return 0
        steps = 0
        with self._client.pipeline(transaction=True) as pipe:
            pipe.watch(self._seq_key)
            applied_seq = int(pipe.get(self._seq_key) or 0)
            with self._lock:
                if self._batch is not None and applied_seq >= self._batch_seq:
                    steps += self._settle_batch()  # applied earlier, only its reply was lost
                if self._batch is None:
                    self._batch, self._batch_seq = {}, self._batch_seq + 1
                _absorb_all(self._batch, self._pending)
                self._pending = {}
                batch, seq = self._batch, self._batch_seq
            if not batch:
                self._batch = None
                return steps
            pipe.multi()
            for name, stats in _to_population(batch).items():
                self._queue_increments(pipe, name, stats)
            pipe.set(self._seq_key, seq, ex=_SEQ_TTL_S)
            pipe.execute()
        with self._lock:
            return steps + self._settle_batch()

    def _queue_increments(self, pipe: redis.client.Pipeline, name: str, stats: DrafterStats) -> None:
        key = self.hash_key(name)
        for fname in _INT_FIELDS:
            if value := getattr(stats, fname):
                pipe.hincrby(key, fname, value)
        for pos, n in stats.accepted_per_pos.items():
            if n:
                pipe.hincrby(key, f"{_ACCEPTED_POS}{pos}", n)
        for pos, n in stats.drafted_per_pos.items():
            pipe.hincrby(key, f"{_DRAFTED_POS}{pos}", n)
        for fname in _FLOAT_FIELDS:
            if value := getattr(stats, fname):
                pipe.hincrbyfloat(key, fname, value)
        pipe.sadd(self._drafters_key, name)

    def _settle_batch(self) -> int:
        """The batch is in Redis: count it into the snapshot and forget it (under ``_lock``)."""
        batch, self._batch = self._batch or {}, None
        _merge_into(self._snapshot, _to_population(batch))
        return sum(t.drafts for t in batch.values())

    def population(self) -> dict[str, DrafterStats]:
        """Redis plus what is pending here; with Redis unreachable, the last snapshot plus pending."""
        with self._io_lock:
            try:
                remote, applied_seq = self._read_remote()
            except Exception as exc:
                self._failed(exc)
            else:
                self._recovered()
                with self._lock:
                    if self._batch is not None and applied_seq >= self._batch_seq:
                        self._batch = None  # applied, reply lost: already part of ``remote``
                    self._snapshot = remote
            with self._lock:
                out = {name: stats.copy() for name, stats in self._snapshot.items()}
                if self._batch:
                    _merge_into(out, _to_population(self._batch))
                return _merge_into(out, _to_population(self._pending))

    def _read_remote(self) -> tuple[Population, int]:
        names = sorted(self._client.smembers(self._drafters_key))
        with self._client.pipeline(transaction=True) as pipe:
            for name in names:
                pipe.hgetall(self.hash_key(name))
            pipe.get(self._seq_key)
            *hashes, seq = pipe.execute()
        return {name: _parse_hash(h) for name, h in zip(names, hashes, strict=True) if h}, int(seq or 0)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self._delay(failures)):
            failures = 0 if self.flush() else failures + 1

    def _delay(self, failures: int) -> float:
        return min(self.flush_interval_s * 2 ** min(failures, 30), self.max_backoff_s)

    def close(self) -> None:
        """Stop the thread, try a final flush (logged if it fails) and close the connections."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._thread.join(timeout=self.max_backoff_s + 5.0)
        if not self.flush():
            logger.warning("stats store closed with %d steps not written to Redis", self.pending_steps())
        self._client.close()

    def _unwritten(self) -> tuple[Tallies, ...]:
        return (self._batch or {}, self._pending)

    def _failed(self, exc: Exception) -> None:
        if not self._failing:
            logger.warning("stats store: Redis unavailable (%s); keeping increments pending", exc)
        self._failing = True
        self._call_hook(self._on_error, exc)

    def _recovered(self) -> None:
        if self._failing:
            logger.info("stats store: Redis reachable again")
        self._failing = False

    @staticmethod
    def _call_hook(hook: Callable[..., None] | None, arg: object) -> None:
        if hook is None:
            return
        try:
            hook(arg)
        except Exception:
            logger.exception("stats store hook %r failed", hook)

    def __enter__(self) -> RedisStatsStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _parse_hash(h: dict[str, str]) -> DrafterStats:
    stats = DrafterStats()
    for fname, value in h.items():
        if fname in _INT_FIELDS:
            setattr(stats, fname, int(value))
        elif fname in _FLOAT_FIELDS:
            setattr(stats, fname, float(value))
        elif fname.startswith(_ACCEPTED_POS):
            stats.accepted_per_pos[int(fname[len(_ACCEPTED_POS) :])] = int(value)
        elif fname.startswith(_DRAFTED_POS):
            stats.drafted_per_pos[int(fname[len(_DRAFTED_POS) :])] = int(value)
    stats._normalize()
    return stats


def open_stats_store(url: str | None, **kwargs: object) -> StatsStore:
    """A ``RedisStatsStore`` on ``url``, or a ``MemoryStatsStore`` when ``url`` is None/empty.

    ``kwargs`` go to ``RedisStatsStore`` (key_prefix, flush_interval_s, on_error, on_flush, ...).
    """
    if url:
        return RedisStatsStore(url, **kwargs)  # type: ignore[arg-type]
    return MemoryStatsStore()
