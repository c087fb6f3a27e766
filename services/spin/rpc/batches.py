"""A service's side of a bidi stream of batches: receive ahead, compute in order.

The router may write a second batch (its other micro-batch) before the first is answered. The
service reads it at once and queues it behind the batch being computed, on the same single worker
thread, so the next forward starts the moment the current one ends: receiving, parsing and
queueing overlap the current forward instead of following it. Responses keep the batches' order
(one worker, first in, first out).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

Batch = TypeVar("Batch")
Result = TypeVar("Result")

READ_AHEAD = 2
"""Batches received and queued behind the one being computed (the router pipelines two)."""


async def in_order(batches: AsyncIterator[Batch], run: Callable[[Batch], Result],
                   worker: ThreadPoolExecutor, ahead: int = READ_AHEAD) -> AsyncIterator[Result]:
    """``run(batch)`` on ``worker`` for every batch of the stream, results in the batches' order;
    up to ``1 + ahead`` batches submitted at once. An exception of ``run`` ends the stream with it
    (batches already submitted still run: a worker thread cannot be interrupted)."""
    loop = asyncio.get_running_loop()
    queued: asyncio.Queue[asyncio.Future | None] = asyncio.Queue()
    room = asyncio.Semaphore(1 + ahead)

    async def receive() -> None:
        try:
            async for batch in batches:
                await room.acquire()
                queued.put_nowait(loop.run_in_executor(worker, run, batch))
        finally:
            queued.put_nowait(None)

    receiver = asyncio.create_task(receive())
    try:
        while (result := await queued.get()) is not None:
            value = await result
            room.release()
            yield value
        await receiver  # the stream's own error, if it ended with one
    finally:
        receiver.cancel()
        while not queued.empty():  # results nobody will read
            if (left := queued.get_nowait()) is not None:
                left.add_done_callback(retrieved)


def retrieved(future: asyncio.Future) -> None:
    """Done callback of a future nobody may await: mark its exception retrieved (no "exception
    was never retrieved" warning)."""
    if not future.cancelled():
        future.exception()
