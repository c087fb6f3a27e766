"""``SuffixShare`` over a real redis-server: routers receive each other's texts (never their own),
a router that starts is seeded with the newest history, the stream stays bounded, and a Redis
outage loses nothing within ``max_pending`` (what is past it is dropped and counted)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import redis

from spin.stats import RedisServer
from spin.stats.suffix_share import SuffixShare, pack, unpack

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

DEADLINE_S = 30.0
"""How long a text may take to arrive (a busy machine; it takes ~poll_s when idle)."""


@pytest.fixture
def shares() -> Iterator[Callable[..., SuffixShare]]:
    """Makes shares (poll_s 0.05), closed after the test."""
    made: list[SuffixShare] = []

    def make(url: str, namespace: str = "tok", **kw: object) -> SuffixShare:
        made.append(SuffixShare(url, namespace, poll_s=0.05, max_backoff_s=0.2, **kw))
        return made[-1]

    yield make
    for s in made:
        s.close()


def until(cond: Callable[[], bool]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, "not within the deadline"
        time.sleep(0.02)


def collect(share: SuffixShare, n: int) -> list[list[int]]:
    """``n`` texts from ``share`` (it fails past the deadline)."""
    got: list[list[int]] = []
    until(lambda: len(got.extend(share.take()) or got) >= n)
    return got


def test_tokens_pack_as_little_endian_uint32() -> None:
    tokens = [0, 1, 255, 256, 151_935, 2**32 - 1]
    assert pack([1, 256]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"
    assert unpack(pack(tokens)) == tokens


def test_routers_receive_each_others_texts_and_not_their_own(
        persistent: RedisServer, shares: Callable[..., SuffixShare]) -> None:
    a, b = shares(persistent.url), shares(persistent.url)
    until(lambda: a.seeded and b.seeded)
    a.publish([1, 2, 3, 4])
    a.publish([5, 6, 7])
    b.publish([9, 9, 9])
    assert collect(b, 2) == [[1, 2, 3, 4], [5, 6, 7]]
    assert collect(a, 1) == [[9, 9, 9]]
    until(lambda: a.published == 2 and b.published == 1)
    time.sleep(0.3)  # several polls more: nobody gets its own back
    assert a.take() == [] and b.take() == []
    assert (a.received, b.received, a.dropped, b.errors) == (1, 2, 0, 0)


def test_a_router_that_starts_is_seeded_with_the_newest_history_of_its_namespace(
        persistent: RedisServer, shares: Callable[..., SuffixShare]) -> None:
    a = shares(persistent.url)
    texts = [[i] * 10 for i in range(1, 8)]  # 70 tokens
    for t in texts:
        a.publish(t)
    until(lambda: a.published == 7)
    late = shares(persistent.url, seed_tokens=45)  # the newest 4 texts fit, not 5
    assert collect(late, 4) == texts[3:]
    other = shares(persistent.url, namespace="another-tokenizer")
    until(lambda: other.seeded)
    a.publish([42, 43])
    assert collect(late, 1) == [[42, 43]]
    time.sleep(0.3)
    assert other.take() == [] and other.received == 0


def test_the_stream_keeps_about_max_entries(persistent: RedisServer,
                                            shares: Callable[..., SuffixShare]) -> None:
    a = shares(persistent.url, max_entries=10, max_pending=600)
    for i in range(600):
        a.publish([i, i + 1])
    until(lambda: a.published == 600)
    with redis.Redis.from_url(persistent.url) as client:
        kept = client.xlen(a.key)
    assert 10 <= kept <= 10 + 100  # MAXLEN ~: Redis trims whole nodes (100 entries each)


def test_an_outage_delays_texts_and_drops_only_past_max_pending(
        persistent: RedisServer, shares: Callable[..., SuffixShare]) -> None:
    a, b = shares(persistent.url, max_pending=3), shares(persistent.url)
    until(lambda: a.seeded and b.seeded)
    persistent.stop()
    for i in range(5):
        a.publish([i, i, i])  # returns at once, Redis or not
    assert a.pending <= 3 and a.dropped >= 2
    until(lambda: a.errors > 0)
    persistent.start()
    got = collect(b, 3)
    assert got == [[2, 2, 2], [3, 3, 3], [4, 4, 4]]  # the newest three; the oldest two dropped
    assert a.dropped == 2 and a.pending == 0


def test_close_sends_what_waits(persistent: RedisServer,
                                shares: Callable[..., SuffixShare]) -> None:
    b = shares(persistent.url)
    until(lambda: b.seeded)
    a = SuffixShare(persistent.url, "tok", poll_s=0.05)
    a.publish([7, 8, 9])
    a.close()
    assert a.pending == 0 and a.dropped == 0
    assert collect(b, 1) == [[7, 8, 9]]
