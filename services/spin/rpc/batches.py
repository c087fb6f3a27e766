"""A service's side of a bidi stream of batches: receive ahead, compute in order.

The router may write a second batch (its other micro-batch) before the first is answered. The
service reads it at once and queues it behind the batch being computed, on the same single worker
thread, so the next forward starts the moment the current one ends: receiving, parsing and
queueing overlap the current forward instead of following it. Responses keep the batches' order
(one worker, first in, first out).

A batch whose ``run`` returns a ``Pending`` (the verifier on CUDA: its forward and decisions
queued on the device) is finished on the worker only once the device is done with it
(``ready``); meanwhile the worker is free, so the next batch's inputs are prepared and queued
while the device computes this one, and a step nears max(host work, device work) rather than
their sum. On the CPU the work is done by the time ``run`` returns: the batch is finished in
the same call on the worker (one hand-off to the worker thread a batch, ~0.2 ms less a round
trip than two).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

Batch = TypeVar("Batch")
Result = TypeVar("Result")

READ_AHEAD = 2
"""Batches received and queued behind the one being computed (the router pipelines two)."""
POLL_S = 0.0002
"""How often a pending batch is asked whether the device is done with it."""


Out = TypeVar("Out", covariant=True)


class Pending(Protocol[Out]):
    """A batch whose work is queued on a device."""

    def ready(self) -> bool:
        """Whether ``finish`` would return without waiting for the device."""
        ...

    def finish(self) -> Out:
        """Wait for the device and build the batch's result (on the worker thread)."""
        ...


async def in_order(batches: AsyncIterator[Batch], run: Callable[[Batch], Result],
                   worker: ThreadPoolExecutor, ahead: int = READ_AHEAD) -> AsyncIterator[Result]:
    """``run(batch)`` on ``worker`` for every batch of the stream, results in the batches' order
    (a ``Pending`` result finished on the worker once ready); up to ``1 + ahead`` batches
    submitted at once. An exception of ``run`` ends the stream with it
    (batches already submitted still run: a worker thread cannot be interrupted)."""
    loop = asyncio.get_running_loop()
    queued: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    room = asyncio.Semaphore(1 + ahead)

    async def receive() -> None:
        try:
            async for batch in batches:
                await room.acquire()
                queued.put_nowait(loop.run_in_executor(worker, _run, run, batch))
        finally:
            queued.put_nowait(None)

    receiver = asyncio.create_task(receive())
    try:
        while (result := await queued.get()) is not None:
            value = await result
            if hasattr(value, "finish"):  # a Pending: the worker is free until the device is done
                try:
                    while not value.ready():
                        await asyncio.sleep(POLL_S)
                    value = await loop.run_in_executor(worker, value.finish)
                except BaseException:  # cancelled: its work is committed all the same
                    settle(worker, value)
                    raise
            room.release()
            yield value
        await receiver  # the stream's own error, if it ended with one
    finally:
        receiver.cancel()
        while not queued.empty():  # results nobody will read (a Pending still finishes)
            if (left := queued.get_nowait()) is not None:
                left.add_done_callback(lambda f: abandoned(worker, f))


def _run(run: Callable[[Batch], Result], batch: Batch) -> Result:
    """``run(batch)``, finished at once when it is a ``Pending`` the device is already done
    with (the CPU): one hand-off to the worker thread per batch instead of two."""
    value = run(batch)
    if hasattr(value, "finish") and value.ready():
        return value.finish()
    return value


def abandoned(worker: ThreadPoolExecutor, future: asyncio.Future) -> None:
    """Done callback of a batch nobody will read: its exception retrieved, its ``Pending``
    settled."""
    if not future.cancelled() and future.exception() is None:
        settle(worker, future.result())


def settle(worker: ThreadPoolExecutor, value: object) -> None:
    """Finish a ``Pending`` nobody will read, on the worker after what it already holds (a
    batch's work is committed whether or not its stream is still there; ``finish`` is
    idempotent)."""
    if hasattr(value, "finish"):
        worker.submit(value.finish).add_done_callback(lambda f: f.exception())


def retrieved(future: asyncio.Future) -> None:
    """Done callback of a future nobody may await: mark its exception retrieved (no "exception
    was never retrieved" warning)."""
    if not future.cancelled():
        future.exception()
