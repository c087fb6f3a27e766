"""The router's streams to drafters and the verifier.

One bidi stream per service replica. Batches are written in order and answered in order; more than
one may be in flight (the router's micro-batches), so a replica receives and queues the next batch
while it computes the current one. A failed or stalled call closes the stream, fails every call in
flight on it, and marks the service down; it is retried after a back-off, on a fresh stream. The
services' per-request contexts survive a reconnect (they answer *resync* for anything they lost,
e.g. after a restart).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import grpc

from ..rpc.batches import retrieved
from ..rpc.serving import CHANNEL_OPTIONS
from ..v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

log = logging.getLogger(__name__)


class ServiceDown(RuntimeError):
    """The service cannot be used now."""


class StreamClient:
    """A bidi stream of batches to one service replica."""

    def __init__(self, name: str, address: str, kind: str, timeout_s: float = 30.0,
                 backoff_s: tuple[float, float] = (0.5, 10.0)) -> None:
        self.name = name
        self.address = address
        self.kind = kind
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        if kind == "drafter":
            self.stub: Any = drafter_pb2_grpc.DrafterStub(self.channel)
        else:
            self.stub = verifier_pb2_grpc.VerifierStub(self.channel)
        self._call: Any = None
        self._reader: asyncio.Task | None = None
        self._pending: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        """(batch id, its response) of the batches written and not yet answered, in order"""
        self._write = asyncio.Lock()
        self._batch = 0
        self._failures = 0
        self._retry_at = 0.0
        self.up = True

    @property
    def available(self) -> bool:
        """Up, or due for another try."""
        return self.up or time.monotonic() >= self._retry_at

    async def info(self, timeout_s: float = 10.0):
        if self.kind == "drafter":
            resp = await self.stub.GetDrafterInfo(drafter_pb2.GetDrafterInfoRequest(),
                                                  timeout=timeout_s, wait_for_ready=True)
        else:
            resp = await self.stub.GetVerifierInfo(verifier_pb2.GetVerifierInfoRequest(),
                                                   timeout=timeout_s, wait_for_ready=True)
        return resp.info

    async def call(self, batch, timeout_s: float | None = None):
        """Send one batch (its batch_id is set here) and return the matching response; calls
        made while others are in flight are written at once and answered after them (so the
        timeout, counted from the write, includes the batches ahead)."""
        if not self.available:
            raise ServiceDown(f"{self.kind} {self.name} is down")
        async with self._write:
            self._batch += 1
            batch.batch_id = self._batch
            answer = asyncio.get_running_loop().create_future()
            answer.add_done_callback(retrieved)  # a timed-out caller no longer awaits it
            try:
                if self._call is None:
                    self._call = (self.stub.Speculate() if self.kind == "drafter"
                                  else self.stub.Verify())
                    self._reader = asyncio.create_task(self._read(self._call))
                self._pending.append((batch.batch_id, answer))
                await self._call.write(batch)
            except Exception as e:  # the stream broke (AioRpcError) or could not be used
                self._mark_down(e)
                if not answer.done():
                    answer.set_exception(ServiceDown(f"{self.kind} {self.name} at "
                                                     f"{self.address}: {_describe(e)}"))
        try:  # shielded: a timed-out wait fails the stream, not just this future
            resp = await asyncio.wait_for(asyncio.shield(answer), timeout_s or self.timeout_s)
        except asyncio.TimeoutError as e:
            self._mark_down(e)
            raise ServiceDown(f"{self.kind} {self.name} at {self.address}: timed out") from e
        if not self.up:
            log.info("%s %s at %s is back", self.kind, self.name, self.address)
        self.up, self._failures = True, 0
        return resp

    async def _read(self, call: Any) -> None:
        """Hand each response of ``call`` to the oldest batch in flight."""
        try:
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise ServiceDown(f"{self.kind} {self.name} closed the stream")
                if not self._pending:
                    raise ServiceDown(f"{self.kind} {self.name} answered batch {resp.batch_id} "
                                      f"with none in flight")
                batch_id, answer = self._pending.popleft()
                if resp.batch_id != batch_id:
                    raise ServiceDown(f"{self.kind} {self.name} answered batch {resp.batch_id} "
                                      f"to batch {batch_id}")
                if not answer.done():
                    answer.set_result(resp)
        except Exception as e:  # AioRpcError, ServiceDown, or a bug: no call waits forever
            if call is self._call:
                self._mark_down(e)

    def _mark_down(self, error: BaseException) -> None:
        """Close the stream and fail every call in flight on it."""
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        self._reader = None
        down = ServiceDown(f"{self.kind} {self.name} at {self.address}: {_describe(error)}")
        while self._pending:
            _, answer = self._pending.popleft()
            if not answer.done():
                answer.set_exception(down)
        self._failures += 1
        delay = min(self.backoff_s[0] * 2 ** (self._failures - 1), self.backoff_s[1])
        self._retry_at = time.monotonic() + delay
        if self.up:
            log.warning("%s %s at %s is down (%s); retrying in %.1f s", self.kind, self.name,
                        self.address, _describe(error), delay)
        self.up = False

    async def close(self) -> None:
        if self._call is not None:
            self._mark_down(ServiceDown("closed"))
        await self.channel.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e)
