"""``RedisStatsStore`` across a shutdown with Redis down: what it could not write is spilled to a
file and written by the next store on that file, exactly once; without a file it is counted lost."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from spin.stats import RedisServer, RedisStatsStore


def drafts(url: str, drafter: str) -> int:
    with redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1) as client:
        return int(client.hget(f"spin:acceptance:{drafter}", "drafts") or 0)


def record(store: RedisStatsStore, steps: int, drafter: str = "small") -> None:
    for i in range(steps):
        store.record(drafter, 4, i % 5, 0.001, 0.002)


def test_unwritten_steps_are_spilled_and_written_by_the_next_store(
        persistent: RedisServer, tmp_path: Path) -> None:
    spill, lost = tmp_path / "pending.json", []
    store = RedisStatsStore(persistent.url, flush_interval_s=60.0, spill_path=spill,
                            on_lost=lost.append)
    record(store, 3)
    assert store.flush()
    record(store, 7)
    record(store, 2, "other")
    persistent.stop()  # data kept on disk
    store.close()
    assert spill.exists() and lost == []
    assert json.loads(spill.read_text())["pending"]["small"]["drafts"] == 7

    persistent.start()
    assert drafts(persistent.url, "small") == 3  # the restart kept what was written
    again = RedisStatsStore(persistent.url, flush_interval_s=60.0, spill_path=spill)
    try:
        assert not spill.exists()
        assert again.pending_steps() == 9
        assert again.flush()
        assert (drafts(persistent.url, "small"), drafts(persistent.url, "other")) == (10, 2)
        assert again.population()["small"].drafts == 10
    finally:
        again.close()
    assert not spill.exists()  # nothing left to keep


def test_a_batch_applied_before_the_shutdown_is_not_written_twice(
        persistent: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """EXEC ran but its reply was lost, then Redis went down: the spilled batch carries its
    sequence number, and the next store sees it was applied."""
    spill = tmp_path / "pending.json"
    store = RedisStatsStore(persistent.url, flush_interval_s=60.0, spill_path=spill)
    original = redis.client.Pipeline.execute
    armed = [True]

    def execute(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        if armed[0] and self.explicit_transaction:
            armed[0] = False
            original(self, raise_on_error)
            raise redis.TimeoutError("reply lost")
        return original(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    record(store, 4)
    assert store.flush() is False and not armed[0]
    record(store, 5)
    persistent.stop()
    store.close()
    state = json.loads(spill.read_text())
    assert state["batch"]["small"]["drafts"] == 4 and state["pending"]["small"]["drafts"] == 5

    persistent.start()
    assert drafts(persistent.url, "small") == 4
    again = RedisStatsStore(persistent.url, flush_interval_s=60.0, spill_path=spill)
    try:
        assert again.flush()
        assert drafts(persistent.url, "small") == 9  # 4 once, then the 5
    finally:
        again.close()


def test_without_a_spill_file_the_loss_is_counted(persistent: RedisServer) -> None:
    lost: list[int] = []
    store = RedisStatsStore(persistent.url, flush_interval_s=60.0, on_lost=lost.append)
    record(store, 6)
    persistent.stop()
    store.close()
    assert lost == [6]


def test_an_unreadable_spill_file_is_reported_and_replaced(
        persistent: RedisServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    spill = tmp_path / "pending.json"
    spill.write_text("{not json")
    store = RedisStatsStore(persistent.url, flush_interval_s=60.0, spill_path=spill)
    assert "its steps are lost" in caplog.text
    record(store, 2)
    persistent.stop()
    store.close()
    assert json.loads(spill.read_text())["pending"]["small"]["drafts"] == 2
