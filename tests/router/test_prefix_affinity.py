"""Cache-aware routing: a new request goes where its prompt's prefix went, unless that replica
is ``slack`` requests busier than the least loaded; a departed replica's prefixes are forgotten;
the table stays within its capacity; and through ``ReplicaPool.keep``."""

from __future__ import annotations

import asyncio

from spin.router.pool import ReplicaPool
from spin.router.prefix_affinity import AffinityConfig, PrefixAffinity

SYSTEM = list(range(100, 164))  # four blocks of 16


class _Stub:
    def __init__(self, name: str, address: str, kind: str) -> None:
        self.available = True

    async def close(self) -> None:
        pass


def test_keys_are_chained_over_full_blocks_only() -> None:
    a = PrefixAffinity(AffinityConfig(max_blocks=3))
    k = a.keys(SYSTEM + [1, 2])
    assert len(k) == 3  # 66 tokens: four full blocks, at most three keyed
    assert a.keys(SYSTEM[:40]) == k[:2]  # the same first blocks: the same keys
    assert a.keys([0] + SYSTEM[1:])[1] != k[1]  # a change in block 0 changes every later key
    assert a.keys(SYSTEM[:15]) == []


def test_a_prefix_goes_home_unless_home_is_too_busy() -> None:
    a = PrefixAffinity(AffinityConfig(slack=2))
    keys = a.keys(SYSTEM)
    assert a.choose(keys, {"a": 0, "b": 0}, "verifier", "") == "a"  # nothing known: least loaded
    a.record(keys, "b")
    assert a.choose(keys, {"a": 0, "b": 2}, "verifier", "") == "b"  # within the slack
    assert a.choose(keys, {"a": 0, "b": 3}, "verifier", "") == "a"  # too busy: load wins
    assert a.choose(a.keys(SYSTEM[:32] + [9] * 32), {"a": 0, "b": 1}, "verifier", "") == "b"
    assert a.choose(keys, {"a": 0}, "verifier", "") == "a"  # home not live
    a.drop("b")
    assert len(a) == 0


def test_the_table_forgets_the_least_recently_used_prefixes() -> None:
    a = PrefixAffinity(AffinityConfig(capacity=6))
    first, second = a.keys(SYSTEM), a.keys(list(range(500, 564)))
    a.record(first, "a")
    a.record(second, "b")
    assert len(a) == 6
    assert a.choose(second, {"a": 0, "b": 0}, "drafter", "d") == "b"
    assert a.choose(first[:1], {"a": 0, "b": 0}, "drafter", "d") == "a"  # first[0..1] left
    assert a.choose(first, {"a": 5, "b": 0}, "drafter", "d") == "a"


def test_the_pool_pins_requests_of_one_prefix_to_one_replica() -> None:
    async def go() -> dict[str, str]:
        pool = ReplicaPool("target", "verifier", ["a:1", "b:1"], client=_Stub)
        for i in range(4):  # a shared system prompt, each request its own question
            pool.keep(f"s{i}", SYSTEM + [i] * 20)
        for i in range(4):  # other prompts still spread by load
            pool.keep(f"o{i}", [7000 + i] * 40)
        return pool.pins

    pins = asyncio.run(go())
    assert len({pins[f"s{i}"] for i in range(4)}) == 1
    assert sorted(pins.values()).count("a:1") == 4  # the others balanced the load


def test_admission_counts_a_remembered_prefix_once() -> None:
    from spin.router.admission import KVBudget

    a = PrefixAffinity()
    assert a.remembered(SYSTEM + [1] * 30) == 0
    a.record(a.keys(SYSTEM + [2] * 20), "v")
    assert a.remembered(SYSTEM + [1] * 30) == 64  # the four system blocks, not the fifth
    kv = KVBudget(16, 100, 100)
    assert kv.try_admit(94, running=1, cached_tokens=64) == 2  # 95 tokens: 6 blocks, 4 cached
    assert kv.try_admit(94, running=1) == 6
    assert kv.pending == 8
