"""Acceptance statistics per drafter: recorded on the decoding path in O(1), aggregated in Redis.

``open_stats_store(url)`` gives a ``RedisStatsStore`` (shared by router replicas, flushed by a
background thread) or, without a URL, a ``MemoryStatsStore``. ``RedisServer`` runs a local
``redis-server`` child process (tests, benchmarks, single-host setups).
"""

from .redis_server import RedisServer, find_redis_server, free_port
from .store import (
    DEFAULT_KEY_PREFIX,
    SAMPLED_SUFFIX,
    DrafterStats,
    MemoryStatsStore,
    StatsStore,
    open_stats_store,
    population_entry,
    population_name,
)
from .redis_store import RedisStatsStore

__all__ = [
    "DEFAULT_KEY_PREFIX",
    "DrafterStats",
    "MemoryStatsStore",
    "RedisServer",
    "RedisStatsStore",
    "SAMPLED_SUFFIX",
    "StatsStore",
    "find_redis_server",
    "free_port",
    "open_stats_store",
    "population_entry",
    "population_name",
]
