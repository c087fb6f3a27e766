"""The statistics tests' Redis: a real redis-server per test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from spin.stats import RedisServer, find_redis_server


@pytest.fixture
def persistent(tmp_path: Path) -> Iterator[RedisServer]:
    """A redis-server whose data survives its restarts (as ``spin serve`` runs it)."""
    if find_redis_server() is None:
        pytest.fail("redis-server is required for tests/stats (apt-get install redis-server)")
    with RedisServer(data_dir=tmp_path / "redis") as server:
        yield server
