"""The router's streams to drafters and the verifier.

One bidi stream per service replica, one batch in flight on it at a time (the router awaits each
response). A failed or stalled call closes the stream and marks the service down; it is retried
after a back-off, on a fresh stream. The services' per-request contexts survive a reconnect (they
answer *resync* for anything they lost, e.g. after a restart).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc

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
        self._lock = asyncio.Lock()
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
        """Send one batch (its batch_id is set here) and return the matching response."""
        if not self.available:
            raise ServiceDown(f"{self.kind} {self.name} is down")
        async with self._lock:
            self._batch += 1
            batch.batch_id = self._batch
            try:
                if self._call is None:
                    self._call = (self.stub.Speculate() if self.kind == "drafter"
                                  else self.stub.Verify())
                await self._call.write(batch)
                resp = await asyncio.wait_for(self._call.read(), timeout_s or self.timeout_s)
                if resp is grpc.aio.EOF:
                    raise ServiceDown(f"{self.kind} {self.name} closed the stream")
                if resp.batch_id != batch.batch_id:
                    raise ServiceDown(f"{self.kind} {self.name} answered batch {resp.batch_id} "
                                      f"to batch {batch.batch_id}")
            except (grpc.aio.AioRpcError, asyncio.TimeoutError, ServiceDown) as e:
                self._mark_down(e)
                raise ServiceDown(f"{self.kind} {self.name} at {self.address}: {_describe(e)}") from e
            if not self.up:
                log.info("%s %s at %s is back", self.kind, self.name, self.address)
            self.up, self._failures = True, 0
            return resp

    def _mark_down(self, error: BaseException) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        self._failures += 1
        delay = min(self.backoff_s[0] * 2 ** (self._failures - 1), self.backoff_s[1])
        self._retry_at = time.monotonic() + delay
        if self.up:
            log.warning("%s %s at %s is down (%s); retrying in %.1f s", self.kind, self.name,
                        self.address, _describe(error), delay)
        self.up = False

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        await self.channel.close()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    if isinstance(e, asyncio.TimeoutError):
        return "timed out"
    return str(e)
