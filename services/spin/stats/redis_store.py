"""Acceptance statistics shared through Redis.

``RedisStatsStore`` flushes that aggregate from a daemon thread, every ``flush_interval_s``, as ONE
MULTI/EXEC transaction of HINCRBY/HINCRBYFLOAT on a hash per drafter (``{prefix}:{drafter}``, fields
``drafts``, ``draft_tokens``, ``accepted_tokens``, ``rejections``, ``accepted_pos:{i}``,
``drafted_pos:{i}``, ``draft_seconds``, ``verify_seconds``) plus SADD of the drafter to ``{prefix}:drafters``. Router
replicas sharing one Redis add up, since they only increment.

Exactly once: a batch whose outcome is unknown (an error, maybe after EXEC ran) is kept with its
sequence number. The same transaction that applies a batch sets ``{prefix}:_applied:{store id}``
to that number, so the next attempt WATCHes that key, reads it, and either drops the batch (it was
applied) or merges the new increments into it and applies both. Redis down: nothing is lost,
``on_error`` is called, retries back off exponentially (capped at ~5 s) and catch up when it returns.

Shutdown with Redis down: ``close`` writes what is unwritten to ``spill_path`` (JSON, written
whole then renamed), and the next store opened on that path takes it back, with the sequence key
and number of its batch of unknown outcome, so the exactly-once rule holds across the restart;
its first flush writes it. Without a ``spill_path``, or when the file cannot be written, the
steps are lost: ``on_lost(steps)`` is called (a metric) and the loss is logged.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from .store import (_ACCEPTED_POS, _DRAFTED_POS, _FLOAT_FIELDS, _INT_FIELDS, DEFAULT_KEY_PREFIX,
                    DrafterStats, Population, Tallies, _absorb_all, _merge_into, _Tally,
                    _TallyingStore, _to_population)

logger = logging.getLogger(__name__)

_SEQ_TTL_S = 7 * 24 * 3600
_SPILL_VERSION = 1


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
        spill_path: Path | str | None = None,
        on_lost: Callable[[int], None] | None = None,
    ) -> None:
        """``on_error(exc)`` is called on every failed Redis operation (a metric hook);
        ``on_flush(steps)`` after every flush that wrote something, with the steps it wrote;
        ``spill_path``: see the module docstring; ``on_lost(steps)`` when steps are dropped."""
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
        self._spill = Path(spill_path) if spill_path else None
        self._on_lost = on_lost
        if self._spill is not None:
            self._take_spill(self._spill)
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
        if not self.flush() and (steps := self.pending_steps()):
            self._keep_unwritten(steps)
        self._client.close()

    def _keep_unwritten(self, steps: int) -> None:
        """Spill what Redis did not get, or count it lost."""
        if self._spill is not None:
            try:
                self._write_spill(self._spill)
            except OSError as e:
                logger.error("stats store: %d steps not written to Redis and not kept (%s: %s)",
                             steps, self._spill, e)
            else:
                logger.warning("stats store: %d steps not written to Redis, kept in %s for the "
                               "next start", steps, self._spill)
                return
        else:
            logger.warning("stats store closed with %d steps not written to Redis (no spill "
                           "file: they are lost)", steps)
        self._call_hook(self._on_lost, steps)

    def _write_spill(self, path: Path) -> None:
        with self._lock:
            state = {"version": _SPILL_VERSION, "seq_key": self._seq_key,
                     "batch_seq": self._batch_seq,
                     "batch": None if self._batch is None else _tallies_json(self._batch),
                     "pending": _tallies_json(self._pending)}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    def _take_spill(self, path: Path) -> None:
        """Adopt what a previous store spilled to ``path`` (and remove the file)."""
        try:
            state = json.loads(path.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as e:
            logger.error("stats store: cannot read %s (%s); its steps are lost", path, e)
            return
        if state.get("version") != _SPILL_VERSION:
            logger.error("stats store: %s has version %r, not %d; its steps are lost", path,
                         state.get("version"), _SPILL_VERSION)
            return
        self._seq_key, self._batch_seq = state["seq_key"], int(state["batch_seq"])
        self._batch = None if state["batch"] is None else _tallies_from_json(state["batch"])
        self._pending = _tallies_from_json(state["pending"])
        path.unlink(missing_ok=True)
        logger.info("stats store: %d steps kept at the last shutdown, from %s, to be written",
                    self.pending_steps(), path)

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


def _tallies_json(tallies: Tallies) -> dict:
    return {name: asdict(t) for name, t in tallies.items()}


def _tallies_from_json(data: dict) -> Tallies:
    out: Tallies = {}
    for name, t in data.items():
        hist = {f: {int(k): int(n) for k, n in t[f].items()} for f in ("k_counts", "accepted_counts")}
        out[name] = _Tally(**{**t, **hist})
    return out


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
