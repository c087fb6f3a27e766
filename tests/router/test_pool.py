"""ReplicaPool: pinning, spreading, moving off departed or failed replicas, release routing.

The replicas here are in-process stand-ins that keep contexts the way a drafter or verifier does
(keep + delta, resync when ``keep`` tokens are not held), so the tests see what a real replica
would answer; the end-to-end test over real processes is in test_discovery.py.
"""

from __future__ import annotations

import asyncio

import pytest

from spin.router.clients import ServiceDown
from spin.router.pool import ReplicaPool
from spin.v1 import verifier_pb2


class ContextBook:
    """A replica's contexts, synced by (keep, delta) as a service keeps them."""

    def __init__(self) -> None:
        self._ctx: dict[str, list[int]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ctx

    def apply(self, request_id: str, keep: int, delta) -> list[int] | None:
        """The context after the update, or None (resync) when ``keep`` tokens are not held."""
        held = self._ctx.get(request_id)
        if keep < 0 or keep > (0 if held is None else len(held)):
            return None
        held = self._ctx.setdefault(request_id, [])
        del held[keep:]
        held.extend(delta)
        return held

    def extend(self, request_id: str, tokens: list[int]) -> None:
        self._ctx[request_id].extend(tokens)

    def release(self, request_id: str) -> None:
        self._ctx.pop(request_id, None)


class Replica:
    """A verifier replica: holds contexts, answers one token per task, can fail."""

    def __init__(self, name: str, address: str, kind: str) -> None:
        self.address = address
        self.book = ContextBook()
        self.calls: list[verifier_pb2.VerifyRequest] = []
        self.available = True
        self.fail = False
        self.closed = False
        self.hang: asyncio.Future | None = None

    async def call(self, batch, timeout_s=None):
        self.calls.append(batch)
        if self.hang is not None:
            await self.hang  # like a gRPC read: cancelled when the stream is closed
        if self.fail:
            raise ServiceDown(f"{self.address} failed")
        for rid in batch.release:
            self.book.release(rid)
        results = []
        for t in batch.tasks:
            ctx = self.book.apply(t.request_id, t.keep, t.context_delta)
            if ctx is None:
                results.append(verifier_pb2.VerifyResult(request_id=t.request_id, resync=True))
            else:
                self.book.extend(t.request_id, [7])
                results.append(verifier_pb2.VerifyResult(request_id=t.request_id, tokens=[7]))
        return verifier_pb2.VerifyResponse(results=results, verify_seconds=0.01)

    async def info(self, timeout_s=10.0):
        return self.address

    async def close(self) -> None:
        self.closed = True
        if self.hang is not None:
            self.hang.cancel()


class Router:
    """The scheduler's side: what each request synced with the service, a step over a batch."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.ctx: dict[str, list[int]] = {}
        self.synced: dict[str, int] = {}

    async def step(self, rids: list[str], release: set[str] = frozenset()):
        tasks = []
        for rid in rids:
            ctx = self.ctx.setdefault(rid, [1, 2, 3])
            keep = self.pool.route(rid, self.synced.get(rid, 0))
            tasks.append(verifier_pb2.VerifyTask(request_id=rid, keep=keep, context_delta=ctx[keep:]))
        resp = await self.pool.call(verifier_pb2.VerifyRequest(tasks=tasks, release=release))
        for rid, res in zip(rids, resp.results):
            assert res.request_id == rid  # merged back in task order
            if res.resync:
                self.synced.pop(rid, None)
            else:
                self.ctx[rid] += list(res.tokens)
                self.synced[rid] = len(self.ctx[rid])
        return resp


def pool_of(*addrs: str) -> tuple[ReplicaPool, dict[str, Replica]]:
    made: dict[str, Replica] = {}

    def client(name, addr, kind):
        made[addr] = Replica(name, addr, kind)
        return made[addr]

    return ReplicaPool("target", "verifier", list(addrs), client=client), made


def run(coro):
    return asyncio.run(coro)


def test_requests_spread_over_replicas_and_stay_pinned() -> None:
    async def go():
        pool, made = pool_of("a:1", "b:1")
        router = Router(pool)
        rids = [f"r{i}" for i in range(6)]
        for _ in range(4):
            resp = await router.step(rids)
            assert not any(r.resync for r in resp.results)
        assert sorted(pool.pins.values()).count("a:1") == 3  # least-loaded: an even spread
        for addr, rep in made.items():
            seen = {t.request_id for c in rep.calls for t in c.tasks}
            assert seen == {r for r, a in pool.pins.items() if a == addr}  # never elsewhere
            assert all(t.keep > 0 for c in rep.calls[1:] for t in c.tasks)  # only deltas after
    run(go())


def test_departed_replica_moves_its_requests_with_whole_context() -> None:
    async def go():
        pool, made = pool_of("a:1", "b:1")
        router = Router(pool)
        rids = ["r0", "r1", "r2", "r3"]
        await router.step(rids)
        on_a = {r for r, a in pool.pins.items() if a == "a:1"}
        pool.set_addresses(["b:1", "c:1"])  # a's pod is gone, c's came
        await asyncio.sleep(0)
        assert made["a:1"].closed
        resp = await router.step(rids)
        assert not any(r.resync for r in resp.results)  # keep = 0 on the new replica: no resync
        moved = [t for c in made["c:1"].calls for t in c.tasks]
        assert {t.request_id for t in moved} == on_a and all(t.keep == 0 for t in moved)
        assert all(len(made["c:1"].book._ctx[r]) == len(router.ctx[r]) for r in on_a)
    run(go())


def test_a_failing_replica_resyncs_only_its_share() -> None:
    async def go():
        pool, made = pool_of("a:1", "b:1")
        router = Router(pool)
        await router.step(["r0", "r1"])
        bad = pool.pins["r0"]
        made[bad].fail = True
        resp = await router.step(["r0", "r1"])
        assert [r.resync for r in resp.results] == [True, False]
        made[bad].available = False
        resp = await router.step(["r0", "r1"])  # r0 moved to the other replica, whole context
        assert not any(r.resync for r in resp.results) and pool.pins["r0"] != bad
        for rep in made.values():
            rep.fail = True
        with pytest.raises(ServiceDown):
            await router.step(["r0", "r1"])
    run(go())


def test_a_replica_leaving_mid_call_resyncs_its_share() -> None:
    async def go():
        pool, made = pool_of("a:1", "b:1")
        router = Router(pool)
        await router.step(["r0", "r1"])
        leaving = pool.pins["r0"]
        made[leaving].hang = asyncio.get_running_loop().create_future()
        step = asyncio.create_task(router.step(["r0", "r1"]))
        await asyncio.sleep(0.01)
        pool.set_addresses([a for a in made if a != leaving])
        resp = await step
        assert [r.resync for r in resp.results] == [True, False]
        resp = await router.step(["r0", "r1"])
        assert not any(r.resync for r in resp.results) and pool.pins["r0"] != leaving
    run(go())


def test_releases_go_to_the_replica_that_holds_the_request() -> None:
    async def go():
        pool, made = pool_of("a:1", "b:1")
        router = Router(pool)
        await router.step(["r0", "r1"])
        where = dict(pool.pins)
        await pool.call(verifier_pb2.VerifyRequest(release=["r0", "r1", "unknown"]))
        for rid, addr in where.items():
            assert rid not in made[addr].book
            other = next(a for a in made if a != addr)
            assert all(rid not in c.release for c in made[other].calls)
        assert not pool.pins
    run(go())


def test_an_empty_pool_is_unavailable_and_fails_calls() -> None:
    async def go():
        pool, _ = pool_of()
        assert not pool.available
        with pytest.raises(ServiceDown):
            await Router(pool).step(["r0"])
        with pytest.raises(ServiceDown):
            await pool.info()
    run(go())
