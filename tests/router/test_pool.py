"""ReplicaPool: pinning, spreading, moving off departed or failed replicas, release routing; and
the typed facades over it (``services.py``): plain tasks in, plain results out.

The replicas here are in-process stand-ins that keep contexts the way a drafter or verifier does
(keep + delta, resync when ``keep`` tokens are not held), so the tests see what a real replica
would answer; the end-to-end test over real processes is in test_discovery.py.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.router.clients import ServiceDown
from spin.router.pool import ReplicaPool
from spin.router.services import (DraftTask, DrafterClient, DrafterClients, VerifierClient,
                                  VerifyReply, VerifyResult, VerifyTask)
from spin.rpc.convert import ReceivedTree, sampling_from_proto, tree_from_proto, tree_to_proto
from spin.v1 import drafter_pb2, token_tree_pb2, verifier_pb2


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
    """The scheduler's side: each request's context, a step over a batch (the pool keeps what
    each replica holds)."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.ctx: dict[str, list[int]] = {}

    async def step(self, rids: list[str], release: set[str] = frozenset()):
        self.pool.release(release)
        tasks = []
        for rid in rids:
            ctx = self.ctx.setdefault(rid, [1, 2, 3])
            keep = self.pool.keep(rid)
            tasks.append(verifier_pb2.VerifyTask(request_id=rid, keep=keep, context_delta=ctx[keep:]))
        resp = await self.pool.call(verifier_pb2.VerifyRequest(tasks=tasks))
        for rid, res in zip(rids, resp.results):
            assert res.request_id == rid  # merged back in task order
            if res.resync:
                self.pool.forget(rid)
            else:
                self.ctx[rid] += list(res.tokens)
                self.pool.hold(rid, len(self.ctx[rid]))
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
        pool.release(["r0", "r1", "unknown"])
        await pool.flush()
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


# ---- the typed facades over a pool (services.py) --------------------------------------------------
class DraftReplica:
    """A drafter replica answering prepared results (``spin.v1`` messages) by request id."""

    def __init__(self, answers: dict[str, drafter_pb2.DraftResult]) -> None:
        self.answers = answers
        self.calls: list[drafter_pb2.SpeculateRequest] = []
        self.available = True

    async def call(self, batch, timeout_s=None):
        self.calls.append(batch)
        return drafter_pb2.SpeculateResponse(
            results=[self.answers.get(t.request_id, drafter_pb2.DraftResult(
                request_id=t.request_id)) for t in batch.tasks], draft_seconds=0.02)

    async def close(self) -> None:
        pass


def test_the_verifier_facade_takes_and_gives_plain_types() -> None:
    async def go():
        pool, made = pool_of("a:1")
        verifier = VerifierClient(pool)
        sampling = SamplingParams(temperature=0.5, top_k=3, seed=11)
        keep = verifier.keep("r0")
        assert keep == 0  # new to the replica: the whole context
        reply = await verifier.verify([VerifyTask("r0", keep, [1, 2, 3], TokenTree.chain([4, 5]),
                                                  sampling, "tp", "ts")])
        assert reply == VerifyReply([VerifyResult("r0", [7], 0)], 0.01, 0, 0)
        (batch,) = made["a:1"].calls
        (task,) = batch.tasks
        assert (task.request_id, task.keep, list(task.context_delta)) == ("r0", 0, [1, 2, 3])
        assert (list(task.tree.tokens), list(task.tree.parents)) == ([4, 5], [-1, 0])
        assert sampling_from_proto(task.sampling) == sampling
        assert (task.traceparent, task.tracestate) == ("tp", "ts")
        verifier.release(["r0"])
        assert verifier.pending_releases
        await verifier.flush()  # a release-only call
        assert list(made["a:1"].calls[-1].release) == ["r0"] and not verifier.pending_releases
        assert "r0" not in made["a:1"].book
    run(go())


def test_draft_probabilities_pass_to_the_verifier_as_they_came() -> None:
    """A sampled draft's probability rows are not decoded in the router: the verifier gets the
    drafter's bytes; a malformed tree costs only its own request the draft."""
    probs = torch.softmax(torch.randn(2, 40, generator=torch.Generator().manual_seed(0)), -1)
    sent = tree_to_proto(TokenTree.chain([5, 6], probs.half()))
    answers = {
        "sampled": drafter_pb2.DraftResult(request_id="sampled", tree=sent),
        "greedy": drafter_pb2.DraftResult(request_id="greedy", tree=token_tree_pb2.TokenTree(
            tokens=[8], parents=[-1])),
        "disordered": drafter_pb2.DraftResult(request_id="disordered", tree=token_tree_pb2.TokenTree(
            tokens=[1, 2], parents=[1, -1])),
        "rows": drafter_pb2.DraftResult(request_id="rows", tree=token_tree_pb2.TokenTree(
            tokens=[1, 2], parents=[-1, 0], probs=sent.probs[:1])),
        "resync": drafter_pb2.DraftResult(request_id="resync", resync=True),
        "scored": drafter_pb2.DraftResult(request_id="scored", score_matches=3, score_positions=4),
    }

    async def go():
        replica = DraftReplica(answers)
        drafter = DrafterClient(ReplicaPool("d", "drafter", ["d:1"], client=lambda *_: replica))
        tasks = [DraftTask(rid, 0, [1, 2], 2, SamplingParams(temperature=1.0), score=rid == "scored")
                 for rid in answers]
        reply = await drafter.draft(tasks, set())
        got = {r.request_id: r for r in reply.results}
        assert [r.request_id for r in reply.results] == list(answers) and reply.draft_seconds == 0.02
        tree = got["sampled"].tree
        assert isinstance(tree, ReceivedTree) and tree.tokens == (5, 6) and tree.draft_probs is None
        assert got["greedy"].tree == TokenTree.chain([8]) and not isinstance(got["greedy"].tree,
                                                                               ReceivedTree)
        assert got["disordered"].tree is None and got["rows"].tree is None
        assert got["resync"].resync and got["resync"].tree is None
        assert (got["scored"].score_matches, got["scored"].score_positions) == (3, 4)
        assert replica.calls[0].tasks[-1].score and not replica.calls[0].tasks[0].score
        pool, made = pool_of("v:1")
        await VerifierClient(pool).verify([VerifyTask("sampled", 0, [1, 2], tree,
                                                      SamplingParams(temperature=1.0))], set())
        (task,) = made["v:1"].calls[0].tasks
        assert task.tree == sent  # the drafter's rows, byte for byte
        back = tree_from_proto(task.tree, 40)
        assert torch.equal(back.draft_probs, probs.half())
    run(go())


def test_drafter_clients_follow_the_pools() -> None:
    async def go():
        pools = {"a": ReplicaPool("a", "drafter")}
        clients = DrafterClients(pools)
        first = clients["a"]
        assert list(clients) == ["a"] and clients["a"] is first and first.pool is pools["a"]
        pools["b"] = ReplicaPool("b", "drafter")  # discovery added a drafter
        assert set(clients) == {"a", "b"} and clients["b"].pool is pools["b"]
        pools["a"] = ReplicaPool("a", "drafter")  # replaced
        assert clients["a"].pool is pools["a"]
        del pools["b"]  # refused by the tokenizer check
        assert "b" not in clients and len(clients) == 1 and clients.get("b") is None
        assert not clients["a"].available  # no replicas yet
    run(go())
