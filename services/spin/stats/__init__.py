"""Acceptance statistics per drafter: recorded on the decoding path in O(1), aggregated in Redis.

``open_stats_store(url)`` gives a ``RedisStatsStore`` (shared by router replicas, flushed by a
background thread) or, without a URL, a ``MemoryStatsStore``. ``RedisServer`` runs a local
``redis-server`` child process (tests, benchmarks, single-host setups).
"""

from .redis_server import RedisServer, find_redis_server, free_port
from .store import (
    DEFAULT_KEY_PREFIX,
    DrafterStats,
    MemoryStatsStore,
    StatsStore,
)
from .redis_store import RedisStatsStore


def open_stats_store(url: str | None, **kwargs: object) -> StatsStore:
    """A ``RedisStatsStore`` on ``url``, or a ``MemoryStatsStore`` when ``url`` is None/empty.

    ``kwargs`` go to ``RedisStatsStore`` (key_prefix, flush_interval_s, on_error, on_flush, ...).
    Here, above both stores, so that neither module imports the other's.
    """
    if url:
        return RedisStatsStore(url, **kwargs)  # type: ignore[arg-type]
    return MemoryStatsStore()


__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DrafterStats",
    "MemoryStatsStore",
    "RedisServer",
    "RedisStatsStore",
    "StatsStore",
    "find_redis_server",
    "free_port",
    "open_stats_store",
]
