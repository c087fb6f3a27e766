"""One logical service (the verifier, or one drafter) over all of its replicas.

A drafter or verifier replica keeps each request's context (and KV cache) between batches, so a
request is **pinned** to one replica: the first time it is routed it goes to the replica its
prompt's prefix was sent to (whose prefix cache likely holds it: ``prefix_affinity.py``) unless
that one is much busier, else to the replica with the fewest pinned requests (spreading work),
and stays there. When its replica leaves (its pod is gone
from discovery) or is down, the request is pinned elsewhere with ``keep = 0``: the new replica gets
the whole context, which costs one prefill and never changes the output. A replica that fails
mid-batch answers *resync* for its share of the batch, so the rest of the batch goes on.

The pool is the one record of what the service holds of each request and what it must free:
``keep`` pins a request and says how many context tokens to keep (what its replica holds, 0 on a
replica new to it), ``hold`` records what it holds after a call, ``forget`` that its state is
unknown (a *resync*: the whole context next time), and ``release`` that the request is done (each
replica that holds it frees it with its next call, or ``flush`` when the router idles). It is
used like one stream: ``call`` (``spin.v1`` batches), ``available``, ``info``, ``close``; the
scheduler reaches it through the typed facades of ``services.py``, which convert its plain tasks
and results. Replicas come from
``set_addresses`` (static in embedded mode; the Kubernetes watch in a cluster, see
``discovery.py``).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal

from ..obs import metrics
from ..v1 import drafter_pb2, verifier_pb2
from .clients import ServiceDown, StreamClient
from .prefix_affinity import PrefixAffinity

log = logging.getLogger(__name__)
Kind = Literal["drafter", "verifier"]


class ReplicaPool:
    """Requests pinned to replicas of one service; batches split by replica and merged back."""

    def __init__(self, name: str, kind: Kind, addresses: list[str] | tuple[str, ...] = (),
                 client: Callable[[str, str, Kind], Any] | None = None) -> None:
        self.name = name
        self.kind = kind
        self._client = client or (lambda n, addr, k: StreamClient(n, addr, k))
        self.replicas: dict[str, Any] = {}
        """address -> StreamClient"""
        self.pins: dict[str, str] = {}
        """request id -> address of the replica holding its context"""
        self.held: dict[str, int] = {}
        """request id -> context tokens its replica holds (absent: none known)"""
        self._releases: dict[str, set[str]] = collections.defaultdict(set)
        """address -> request ids to release there at its next call"""
        self._closing: set[asyncio.Task] = set()
        self.affinity = PrefixAffinity()
        """Where each prompt prefix was sent (cache-aware routing)."""
        self.set_addresses(addresses)

    # ---- membership ------------------------------------------------------------------------------
    @property
    def addresses(self) -> list[str]:
        return sorted(self.replicas)

    def set_addresses(self, addresses: list[str] | tuple[str, ...] | set[str]) -> None:
        """The replicas now: new ones join, departed ones are closed and their requests unpinned."""
        wanted = set(addresses)
        for addr in sorted(wanted - set(self.replicas)):
            log.info("%s %s: replica %s joined", self.kind, self.name, addr)
            self.replicas[addr] = self._client(self.name, addr, self.kind)
        for addr in sorted(set(self.replicas) - wanted):
            log.info("%s %s: replica %s left", self.kind, self.name, addr)
            client = self.replicas.pop(addr)
            self._releases.pop(addr, None)
            self.affinity.drop(addr)
            for rid in [r for r, a in self.pins.items() if a == addr]:
                self._unpin(rid)  # routed afresh, with the whole context, at its next step
            task = asyncio.get_running_loop().create_task(client.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        metrics.REPLICAS.labels(self.kind, self.name if self.kind == "drafter" else "").set(
            len(self.replicas))
        if self.kind == "drafter":  # a failed call sets it to 0 again
            metrics.DRAFTER_UP.labels(self.name).set(1 if self.replicas else 0)

    @property
    def available(self) -> bool:
        """Some replica is up, or due for another try."""
        return any(c.available for c in self.replicas.values())

    # ---- what each replica holds ----------------------------------------------------------------
    def keep(self, request_id: str, prompt: Sequence[int] = ()) -> int:
        """Pin the request (if it is not, or its replica is gone or down) and return the context
        tokens to keep: what its replica holds, 0 on a replica that never saw it. A request
        pinned anew goes where its ``prompt``'s prefix was sent, if that replica is not much
        busier than the others (``prefix_affinity.py``), else to the least loaded."""
        addr = self.pins.get(request_id)
        client = self.replicas.get(addr) if addr else None
        if client is not None and (client.available or not self.available):
            return self.held.get(request_id, 0)
        live = [a for a, c in self.replicas.items() if c.available] or list(self.replicas)
        if not live:  # nothing to pin to: the call fails and the scheduler handles it
            return self.held.get(request_id, 0)
        pinned = collections.Counter(self.pins.values())
        keys = self.affinity.keys(prompt)
        new = self.affinity.choose(keys, {a: pinned[a] for a in live}, self.kind,
                                   self.name if self.kind == "drafter" else "")
        self.affinity.record(keys, new)
        if addr in self.replicas:  # moved off a replica that is down: free it there when back
            self._releases[addr].add(request_id)
        self.pins[request_id] = new
        self.held.pop(request_id, None)
        return 0

    def hold(self, request_id: str, tokens: int) -> None:
        """After a call: the request's replica holds ``tokens`` context tokens."""
        self.held[request_id] = tokens

    def forget(self, request_id: str) -> None:
        """What the replica holds of the request is unknown: the whole context next time."""
        self.held.pop(request_id, None)

    def release(self, request_ids: set[str] | list[str]) -> None:
        """Forget requests; each replica that holds one frees it with its next call."""
        for rid in request_ids:
            addr = self.pins.pop(rid, None)
            self.held.pop(rid, None)
            if addr in self.replicas:
                self._releases[addr].add(rid)

    @property
    def pending_releases(self) -> bool:
        """Some replica has requests to free at its next call."""
        return any(ids for a, ids in self._releases.items() if a in self.replicas)

    async def flush(self) -> None:
        """Send the pending releases alone (the router idles: free the caches now)."""
        if self.pending_releases and self.available:
            try:
                await self.call(self._batch([]))
            except ServiceDown as e:
                log.info("%s %s: release call failed: %s", self.kind, self.name, e)

    def _unpin(self, request_id: str) -> None:
        """The request's replica is gone with what it held: routed afresh at its next call."""
        self.pins.pop(request_id, None)
        self.held.pop(request_id, None)

    # ---- calls -----------------------------------------------------------------------------------
    async def info(self, timeout_s: float = 10.0):
        """The model info of the first replica that answers."""
        errors = []
        for addr, client in sorted(self.replicas.items()):
            try:
                return await client.info(timeout_s)
            except Exception as e:  # noqa: BLE001 - try the next replica
                errors.append(f"{addr}: {e}")
        raise ServiceDown(f"{self.kind} {self.name}: no replica answered ({'; '.join(errors)})")

    async def call(self, batch, timeout_s: float | None = None):
        """Send a batch's tasks to their replicas (with each one's pending releases) and return one
        response, results in the batch's task order. A replica that fails answers *resync* for its
        tasks; ServiceDown only when every replica with tasks failed."""
        if batch.tasks and not self.replicas:
            raise ServiceDown(f"{self.kind} {self.name} has no replicas")
        groups: dict[str, list[int]] = collections.defaultdict(list)
        for i, task in enumerate(batch.tasks):
            if task.request_id not in self.pins:
                task.keep = self.keep(task.request_id)
            groups[self.pins[task.request_id]].append(i)
        targets = set(groups) if batch.tasks else {a for a, ids in self._releases.items() if ids}
        targets &= set(self.replicas)
        order = sorted(targets)
        if len(order) == 1 and batch.tasks and len(groups[order[0]]) == len(batch.tasks):
            # the common case, one replica holds the whole batch: send it as it is (no copies)
            try:
                return await self._call_one(order[0], batch, timeout_s)
            except ServiceDown:
                for task in batch.tasks:  # lost with the replica: routed afresh next step
                    self._unpin(task.request_id)
                raise
        outcomes = await asyncio.gather(*(self._call_one(a, self._batch([batch.tasks[i] for i in
                                                                          groups[a]]), timeout_s)
                                          for a in order), return_exceptions=True)
        results: list[Any] = [None] * len(batch.tasks)
        seconds, failed, free, blocks = 0.0, [], 0, 0
        for addr, outcome in zip(order, outcomes):
            idx = groups.get(addr, [])
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, ServiceDown):
                    raise outcome
                failed.append(outcome)
                for i in idx:  # lost with the replica: routed afresh next step
                    self._unpin(batch.tasks[i].request_id)
                    results[i] = self._resync(batch.tasks[i].request_id)
                continue
            seconds = max(seconds, _seconds(outcome))
            free, blocks = free + outcome.free_blocks, blocks + outcome.num_blocks
            for i, res in zip(idx, outcome.results):
                results[i] = res
        if failed and len(failed) == len(order) and batch.tasks:
            raise failed[0]
        # several replicas: their blocks together (each request is pinned to one of them)
        if self.kind == "drafter":
            return drafter_pb2.SpeculateResponse(results=results, draft_seconds=seconds,
                                                 free_blocks=free, num_blocks=blocks)
        return verifier_pb2.VerifyResponse(results=results, verify_seconds=seconds,
                                           free_blocks=free, num_blocks=blocks)

    def _batch(self, tasks: list):
        return (drafter_pb2.SpeculateRequest(tasks=tasks) if self.kind == "drafter"
                else verifier_pb2.VerifyRequest(tasks=tasks))

    async def _call_one(self, addr: str, req, timeout_s: float | None):
        """Send ``req`` (its release list replaced by the replica's pending releases)."""
        release = self._releases.pop(addr, set())
        del req.release[:]
        req.release.extend(sorted(release))
        try:
            return await self.replicas[addr].call(req, timeout_s)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # we are being cancelled ourselves
            # the replica left mid-call: closing its stream cancelled the call
            raise ServiceDown(f"{self.kind} {self.name}: replica {addr} left mid-call") from None
        except ServiceDown:
            if addr in self.replicas:
                self._releases[addr] |= release  # try again when it is back
            raise

    def _resync(self, request_id: str):
        if self.kind == "drafter":
            return drafter_pb2.DraftResult(request_id=request_id, resync=True)
        return verifier_pb2.VerifyResult(request_id=request_id, resync=True)

    async def close(self) -> None:
        for client in self.replicas.values():
            await client.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


def _seconds(resp) -> float:
    return resp.draft_seconds if isinstance(resp, drafter_pb2.SpeculateResponse) else resp.verify_seconds
