"""Acceptance statistics stores against a real ``redis-server`` (started here on a free port)."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis

from spin.stats import (
    DrafterStats,
    MemoryStatsStore,
    RedisServer,
    RedisStatsStore,
    StatsStore,
    find_redis_server,
    free_port,
    open_stats_store,
)
from spin.policy.population import population_entry, population_name

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

Step = tuple[str, int, int, float, float]

# (drafter, k, accepted, draft_s, verify_s)
STEPS_A: list[Step] = [
    ("small", 4, 2, 0.010, 0.020),
    ("small", 4, 4, 0.012, 0.021),
    ("small", 3, 0, 0.011, 0.019),
    ("small", 2, 1, 0.009, 0.022),
    ("lookup", 5, 0, 0.001, 0.030),
    ("lookup", 5, 5, 0.002, 0.031),
]
# Hand-computed from STEPS_A.
SMALL_A = DrafterStats(
    drafts=4,
    draft_tokens=13,
    accepted_tokens=7,
    rejections=3,
    accepted_per_pos={1: 3, 2: 2, 3: 1, 4: 1},
    drafted_per_pos={1: 4, 2: 4, 3: 3, 4: 2},
    draft_seconds=0.042,
    verify_seconds=0.082,
)
LOOKUP_A = DrafterStats(
    drafts=2,
    draft_tokens=10,
    accepted_tokens=5,
    rejections=1,
    accepted_per_pos={1: 1, 2: 1, 3: 1, 4: 1, 5: 1},
    drafted_per_pos={1: 2, 2: 2, 3: 2, 4: 2, 5: 2},
    draft_seconds=0.003,
    verify_seconds=0.061,
)
STEPS_B: list[Step] = [
    ("small", 1, 1, 0.005, 0.010),
    ("small", 4, 3, 0.006, 0.011),
    ("medium", 2, 0, 0.020, 0.012),
]
SMALL_B = DrafterStats(
    drafts=2,
    draft_tokens=5,
    accepted_tokens=4,
    rejections=1,
    accepted_per_pos={1: 2, 2: 1, 3: 1, 4: 0},
    drafted_per_pos={1: 2, 2: 1, 3: 1, 4: 1},
    draft_seconds=0.011,
    verify_seconds=0.021,
)
MEDIUM_B = DrafterStats(
    drafts=1,
    draft_tokens=2,
    accepted_tokens=0,
    rejections=1,
    accepted_per_pos={1: 0, 2: 0},
    drafted_per_pos={1: 1, 2: 1},
    draft_seconds=0.020,
    verify_seconds=0.012,
)


def record_all(store: StatsStore, steps: list[Step]) -> None:
    for step in steps:
        store.record(*step)


def assert_population(actual: dict[str, DrafterStats], expected: dict[str, DrafterStats]) -> None:
    assert sorted(actual) == sorted(expected)
    for name, exp in expected.items():
        got = actual[name]
        assert (got.drafts, got.draft_tokens, got.accepted_tokens, got.rejections) == (
            exp.drafts,
            exp.draft_tokens,
            exp.accepted_tokens,
            exp.rejections,
        ), name
        assert got.accepted_per_pos == exp.accepted_per_pos, name
        assert got.drafted_per_pos == exp.drafted_per_pos, name
        assert got.draft_seconds == pytest.approx(exp.draft_seconds, abs=1e-9), name
        assert got.verify_seconds == pytest.approx(exp.verify_seconds, abs=1e-9), name


def merged(*pops: dict[str, DrafterStats]) -> dict[str, DrafterStats]:
    out: dict[str, DrafterStats] = {}
    for pop in pops:
        for name, stats in pop.items():
            out.setdefault(name, DrafterStats()).merge(stats)
    return out


POP_A = {"small": SMALL_A, "lookup": LOOKUP_A}
POP_B = {"small": SMALL_B, "medium": MEDIUM_B}


def wait_for(cond: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def raw_drafts(url: str, drafter: str) -> int:
    """``drafts`` of one drafter straight from Redis (-1 when unreachable)."""
    try:
        with redis.Redis.from_url(url, socket_timeout=0.5, socket_connect_timeout=0.5) as client:
            return int(client.hget(f"spin:acceptance:{drafter}", "drafts") or 0)
    except redis.RedisError:
        return -1


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    if find_redis_server() is None:
        pytest.fail("redis-server is required for tests/stats (apt-get install redis-server)")
    with RedisServer() as server:
        yield server


@pytest.fixture
def make_store() -> Iterator[Callable[..., RedisStatsStore]]:
    stores: list[RedisStatsStore] = []

    def make(url: str, **kwargs: object) -> RedisStatsStore:
        kwargs.setdefault("flush_interval_s", 60.0)  # tests flush by hand unless they say otherwise
        store = RedisStatsStore(url, **kwargs)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


# ---------------------------------------------------------------------- DrafterStats / memory
def test_drafter_stats_properties_hand_computed() -> None:
    assert SMALL_A.acceptance_rate == pytest.approx(7 / 13)
    assert SMALL_A.mean_accepted_length == pytest.approx(2.75)  # 1 + 7/4, bonus token included
    assert SMALL_A.acceptance_at(1) == pytest.approx(3 / 4)
    assert SMALL_A.acceptance_at(3) == pytest.approx(1 / 3)
    assert SMALL_A.acceptance_at(4) == pytest.approx(1 / 2)
    assert SMALL_A.acceptance_at(5) == 0.0
    assert LOOKUP_A.mean_accepted_length == pytest.approx(3.5)
    assert LOOKUP_A.acceptance_rate == pytest.approx(0.5)
    # chains stop at their first rejection: 7 accepted, 3 rejections (the MLE the policy uses)
    assert SMALL_A.chain_acceptance == pytest.approx(7 / 10)
    assert LOOKUP_A.chain_acceptance == pytest.approx(5 / 6)
    before = DrafterStats(drafts=2, draft_tokens=8, accepted_tokens=3)  # no rejections counted
    assert before.chain_acceptance == pytest.approx(3 / 8)  # (an older record): the token rate
    whole = DrafterStats(drafts=2, draft_tokens=8, accepted_tokens=8)
    assert whole.chain_acceptance == 1.0
    empty = DrafterStats()
    assert (empty.acceptance_rate, empty.mean_accepted_length, empty.acceptance_at(1),
            empty.chain_acceptance) == (0.0, 0.0, 0.0, 0.0)
    total = SMALL_A.copy().merge(SMALL_B)
    assert (total.drafts, total.draft_tokens, total.accepted_tokens) == (6, 18, 11)
    assert total.accepted_per_pos == {1: 5, 2: 3, 3: 2, 4: 1}
    assert total.drafted_per_pos == {1: 6, 2: 5, 3: 4, 4: 3}
    assert total.mean_accepted_length == pytest.approx(1 + 11 / 6)
    assert SMALL_A.drafts == 4  # copy() left the original alone


def test_memory_store_exact_sums() -> None:
    store = MemoryStatsStore()
    assert isinstance(store, StatsStore)
    record_all(store, STEPS_A)
    assert_population(store.population(), POP_A)
    record_all(store, STEPS_B)
    assert store.flush() is True
    assert_population(store.population(), merged(POP_A, POP_B))
    assert store.pending_steps() == 9
    store.close()
    store.close()


def test_record_counts_a_tree_by_its_depth_not_its_nodes() -> None:
    """A tree of 7 nodes whose accepted path of 3 reached its depth was not rejected: the
    caller says so (``rejected``); a chain's rule (accepted < k) would count a rejection."""
    store = MemoryStatsStore()
    store.record("tree", 7, 3, 0.01, 0.02, rejected=False)
    store.record("tree", 7, 1, 0.01, 0.02, rejected=True)
    tree = store.population()["tree"]
    assert (tree.rejections, tree.chain_acceptance) == (1, pytest.approx(4 / 5))


def test_record_never_raises_on_bad_input() -> None:
    store = MemoryStatsStore()
    store.record("small", -1, 0, 0.1, 0.1)  # dropped
    store.record("drafters", 2, 1, 0.1, 0.1)  # reserved name: dropped
    store.record("small", "abc", 1, 0.1, 0.1)  # type: ignore[arg-type]  # dropped
    store.record("small", 3, 7, float("nan"), -1.0)  # accepted clamped to 3, bad seconds -> 0
    store.record("small", 2, -4, 0.5, 0.25)  # accepted clamped to 0
    pop = store.population()
    assert list(pop) == ["small"]
    small = pop["small"]
    assert (small.drafts, small.draft_tokens, small.accepted_tokens) == (2, 5, 3)
    assert small.rejections == 1  # accepted 0 of 2; the clamped 3 of 3 is whole
    assert small.accepted_per_pos == {1: 1, 2: 1, 3: 1}
    assert small.drafted_per_pos == {1: 2, 2: 2, 3: 1}
    assert (small.draft_seconds, small.verify_seconds) == (0.5, 0.25)


def test_open_stats_store(redis_server: RedisServer) -> None:
    memory = open_stats_store(None)
    assert isinstance(memory, MemoryStatsStore)
    store = open_stats_store(redis_server.url, flush_interval_s=60.0)
    try:
        assert isinstance(store, RedisStatsStore) and isinstance(store, StatsStore)
    finally:
        store.close()


# ---------------------------------------------------------------------- Redis
def test_redis_flush_then_population_exact(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    store = make_store(redis_server.url)
    record_all(store, STEPS_A)
    assert_population(store.population(), POP_A)  # pending only, nothing in Redis yet
    assert raw_drafts(redis_server.url, "small") == 0
    assert store.flush() is True
    assert store.pending_steps() == 0
    assert_population(store.population(), POP_A)  # now all from Redis
    pop = store.population()
    assert pop["small"].mean_accepted_length == pytest.approx(2.75)
    assert pop["small"].acceptance_rate == pytest.approx(7 / 13)
    assert pop["lookup"].acceptance_at(5) == pytest.approx(1 / 2)

    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    assert client.smembers("spin:acceptance:drafters") == {"small", "lookup"}
    raw = client.hgetall("spin:acceptance:small")
    assert raw["drafts"] == "4" and raw["draft_tokens"] == "13" and raw["accepted_tokens"] == "7"
    assert raw["rejections"] == "3"
    assert raw["accepted_pos:3"] == "1" and raw["drafted_pos:3"] == "3" and raw["drafted_pos:4"] == "2"
    assert float(raw["draft_seconds"]) == pytest.approx(0.042)
    client.close()

    record_all(store, STEPS_B)
    assert store.flush() is True
    assert store.flush() is True  # nothing pending: no double counting
    assert_population(store.population(), merged(POP_A, POP_B))


def test_greedy_and_sampled_steps_keep_separate_entries_in_redis(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    assert population_name("small", greedy=True) == "small"
    assert population_name("small", greedy=False) == "small@sampled"
    entries = {"small": 1, "small@sampled": 2, "big": 3}
    assert population_entry(entries, "small", greedy=False) == 2
    assert population_entry(entries, "big", greedy=False) == 3  # the other decoding stands in
    assert population_entry(entries, "none", greedy=True) is None
    store = make_store(redis_server.url)
    store.record(population_name("small", True), 4, 3, 0.01, 0.02)
    store.record(population_name("small", False), 4, 1, 0.01, 0.02)
    store.record(population_name("small", False), 2, 0, 0.01, 0.02)
    assert store.flush() is True
    pop = store.population()
    assert (pop["small"].drafts, pop["small"].accepted_tokens) == (1, 3)
    assert (pop["small@sampled"].drafts, pop["small@sampled"].draft_tokens) == (2, 6)
    assert pop["small@sampled"].accepted_tokens == 1


def test_background_thread_flushes(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    flushed: list[int] = []
    store = make_store(redis_server.url, flush_interval_s=0.05, on_flush=flushed.append)
    record_all(store, STEPS_A)
    assert wait_for(lambda: raw_drafts(redis_server.url, "lookup") == 2 and store.pending_steps() == 0)
    assert raw_drafts(redis_server.url, "small") == 4
    assert sum(flushed) == 6


def test_redis_down_no_loss_and_catch_up(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    errors: list[Exception] = []
    store = make_store(redis_server.url, flush_interval_s=0.05, on_error=errors.append)
    record_all(store, STEPS_A)
    assert store.flush() is True
    assert_population(store.population(), POP_A)

    redis_server.stop()
    worst = 0.0
    for _ in range(50):  # the background thread keeps failing meanwhile
        for step in STEPS_B:
            t0 = time.perf_counter()
            store.record(*step)
            worst = max(worst, time.perf_counter() - t0)
        time.sleep(0.002)
    assert worst < 0.010, f"record took {worst * 1e3:.1f} ms with Redis down"
    t0 = time.perf_counter()
    assert store.flush() is False
    assert time.perf_counter() - t0 < 1.0
    assert errors and all(isinstance(e, redis.RedisError) for e in errors)
    assert store.pending_steps() == 150
    b50 = merged(*[POP_B] * 50)
    assert_population(store.population(), merged(POP_A, b50))  # last snapshot + pending

    # The test server keeps nothing across a restart (no persistence): Redis must end up with
    # exactly what was recorded while it was down, written once.
    redis_server.restart()
    assert wait_for(lambda: store.pending_steps() == 0, timeout_s=8.0), "no catch-up after restart"
    assert raw_drafts(redis_server.url, "small") == 100
    time.sleep(0.3)  # more background flushes: nothing counted twice
    assert raw_drafts(redis_server.url, "medium") == 50
    assert_population(store.population(), b50)


def test_hung_redis_does_not_stall(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    """A Redis that accepts connections but never answers (SIGSTOP): short socket timeouts."""
    errors: list[Exception] = []
    store = make_store(redis_server.url, flush_interval_s=0.05, on_error=errors.append)
    record_all(store, STEPS_A)
    assert wait_for(lambda: store.pending_steps() == 0)
    pid = redis_server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        took: list[float] = []
        deadline = time.monotonic() + 1.5  # the flush thread is stuck in socket reads meanwhile
        while time.monotonic() < deadline:
            for step in STEPS_B:
                t0 = time.perf_counter()
                store.record(*step)
                took.append(time.perf_counter() - t0)
            time.sleep(0.01)
        # a record that waited on the socket would take its 0.5 s timeout; on a busy machine
        # one call may still lose the CPU for tens of ms (27 ms seen in CI), so the bound on the
        # worst is a fifth of that timeout and the typical call must be quick
        took.sort()
        median, worst = took[len(took) // 2], took[-1]
        assert median < 0.010 and worst < 0.1, \
            f"record took {median * 1e3:.1f} ms (median), {worst * 1e3:.1f} ms (worst), Redis hung"
        t0 = time.perf_counter()
        assert store.flush() is False
        pop = store.population()
        assert time.perf_counter() - t0 < 3.0  # each waits at most one other attempt + its own
        assert errors and any(isinstance(e, redis.TimeoutError) for e in errors)
        recorded = store.pending_steps()
        assert recorded > 0 and recorded % 3 == 0
        assert pop["medium"].drafts == recorded // 3
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_for(lambda: store.pending_steps() == 0, timeout_s=8.0), "no catch-up after SIGCONT"
    time.sleep(0.3)
    bn = merged(*[POP_B] * (recorded // 3))
    assert_population(store.population(), merged(POP_A, bn))


def test_population_with_redis_down_never_raises(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    errors: list[Exception] = []
    store = make_store(redis_server.url, on_error=errors.append)
    record_all(store, STEPS_A)
    assert store.flush() is True
    assert_population(store.population(), POP_A)
    redis_server.stop()
    record_all(store, STEPS_B)
    t0 = time.perf_counter()
    pop = store.population()
    assert time.perf_counter() - t0 < 1.0
    assert_population(pop, merged(POP_A, POP_B))
    assert errors

    never_up = make_store(f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there
    record_all(never_up, STEPS_B)
    assert never_up.flush() is False
    assert_population(never_up.population(), POP_B)


@pytest.mark.parametrize("read_in_between", [False, True])
@pytest.mark.parametrize("exec_ran", [True, False], ids=["reply-lost", "exec-not-run"])
def test_failed_exec_is_applied_exactly_once(
    redis_server: RedisServer,
    make_store: Callable[..., RedisStatsStore],
    monkeypatch: pytest.MonkeyPatch,
    exec_ran: bool,
    read_in_between: bool,
) -> None:
    """The flush transaction fails at EXEC, after or before Redis applied it: no loss, no double."""
    store = make_store(redis_server.url)
    original = redis.client.Pipeline.execute
    armed = [True]

    def execute(self: redis.client.Pipeline, raise_on_error: bool = True) -> list[object]:
        is_flush = self.explicit_transaction  # WATCH ... MULTI: the flush, not a read
        if armed[0] and is_flush:
            armed[0] = False
            if exec_ran:
                original(self, raise_on_error)  # applied; only the reply gets "lost"
            else:
                self.reset()
            raise redis.TimeoutError("simulated failure at EXEC")
        return original(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    record_all(store, STEPS_A)
    assert store.flush() is False
    assert not armed[0], "the simulated failure did not trigger"
    assert raw_drafts(redis_server.url, "small") == (4 if exec_ran else 0)
    assert store.pending_steps() == 6  # outcome unknown to the store: still its responsibility
    if read_in_between:
        assert_population(store.population(), POP_A)
    record_all(store, STEPS_B)
    assert store.flush() is True
    assert raw_drafts(redis_server.url, "small") == 6
    assert_population(store.population(), merged(POP_A, POP_B))
    assert store.pending_steps() == 0


def test_two_replicas_sum(redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]) -> None:
    one = make_store(redis_server.url)
    two = make_store(redis_server.url)
    record_all(one, STEPS_A)
    record_all(two, STEPS_B)
    assert one.flush() and two.flush()
    assert_population(one.population(), merged(POP_A, POP_B))
    assert_population(two.population(), merged(POP_A, POP_B))


def test_two_replicas_concurrent_recording(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    replicas = [make_store(redis_server.url, flush_interval_s=0.01) for _ in range(2)]

    def work(store: RedisStatsStore) -> None:
        for i in range(2000):
            store.record("small", 4, i % 5, 0.001, 0.002)

    threads = [threading.Thread(target=work, args=(store,)) for store in replicas for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for store in replicas:
        store.close()
    pop = replicas[0].population()
    small = pop["small"]
    # 4 threads x 2000 steps, accepted cycling 0..4 (400 of each per thread).
    assert (small.drafts, small.draft_tokens, small.accepted_tokens) == (8000, 32000, 16000)
    assert small.accepted_per_pos == {1: 6400, 2: 4800, 3: 3200, 4: 1600}
    assert small.drafted_per_pos == {1: 8000, 2: 8000, 3: 8000, 4: 8000}
    assert small.draft_seconds == pytest.approx(8.0)
    assert small.mean_accepted_length == pytest.approx(3.0)


def test_close_flushes_and_is_idempotent(
    redis_server: RedisServer, make_store: Callable[..., RedisStatsStore]
) -> None:
    store = make_store(redis_server.url)
    record_all(store, STEPS_A)
    store.close()
    assert raw_drafts(redis_server.url, "small") == 4
    store.close()
    assert_population(store.population(), POP_A)
