"""Receiving batches ahead: the next batch is taken off the stream while the current computes."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from spin.rpc.batches import in_order


async def _stream(items: list[int], received: list[int]):
    for item in items:
        received.append(item)
        await asyncio.sleep(0)
        yield item


def test_the_next_batch_is_received_while_the_current_computes() -> None:
    """Batch 0's computation waits until batch 1 has been received: without reading ahead this
    would stall (and fail on the wait's timeout)."""
    received: list[int] = []
    worker = ThreadPoolExecutor(1)
    saw_next = threading.Event()

    def run(batch: int) -> int:
        if batch == 0:
            assert saw_next.wait(5), "batch 1 was not received while batch 0 computed"
        return batch * 10

    async def main() -> list[int]:
        async def stream():
            async for b in _stream([0, 1, 2, 3], received):
                if b == 1:
                    saw_next.set()
                yield b
        return [r async for r in in_order(stream(), run, worker)]

    assert asyncio.run(main()) == [0, 10, 20, 30]  # in the batches' order
    assert received == [0, 1, 2, 3]


def test_read_ahead_is_bounded() -> None:
    """With ``ahead=1`` at most two batches are submitted while the first computes."""
    received: list[int] = []
    worker = ThreadPoolExecutor(1)
    release = threading.Event()
    seen_while_blocked: list[int] = []

    def run(batch: int) -> int:
        if batch == 0:
            release.wait(5)
        return batch

    async def main() -> list[int]:
        gen = in_order(_stream(list(range(6)), received), run, worker, ahead=1)
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.2)  # batch 0 computes; the receiver runs ahead as far as it may
        seen_while_blocked.extend(received)
        release.set()
        return [await first] + [r async for r in gen]

    assert asyncio.run(main()) == list(range(6))
    assert seen_while_blocked == [0, 1, 2]  # 0 and 1 submitted, 2 read and waiting for room


def test_an_error_ends_the_stream_with_it() -> None:
    worker = ThreadPoolExecutor(1)

    def run(batch: int) -> int:
        if batch == 1:
            raise ValueError("bad batch 1")
        return batch

    async def main() -> list[int]:
        out = []
        with pytest.raises(ValueError, match="bad batch 1"):
            async for r in in_order(_stream([0, 1, 2], []), run, worker):
                out.append(r)
        return out

    assert asyncio.run(main()) == [0]


def test_a_pending_batch_frees_the_worker_until_its_device_is_done() -> None:
    """``run`` returns a Pending (work queued on a device): the next batch starts on the worker
    before the first finishes, and results still come in the batches' order."""
    worker = ThreadPoolExecutor(1)
    log: list[str] = []
    device_done = threading.Event()

    class Queued:
        def __init__(self, batch: int) -> None:
            self.batch = batch

        def ready(self) -> bool:
            return self.batch != 0 or device_done.is_set()

        def finish(self) -> int:
            log.append(f"finish {self.batch}")
            return self.batch * 10

    def start(batch: int) -> Queued:
        log.append(f"start {batch}")
        if batch == 1:
            device_done.set()  # batch 0's device work ends while batch 1 is prepared
        return Queued(batch)

    async def main() -> list[int]:
        return [r async for r in in_order(_stream([0, 1, 2], []), start, worker)]

    assert asyncio.run(main()) == [0, 10, 20]
    assert log.index("start 1") < log.index("finish 0")
    assert log.count("finish 0") == 1


def test_a_pending_batch_nobody_reads_still_finishes() -> None:
    """The stream's reader goes away while a batch is on the device: it finishes anyway (its
    requests' caches are committed), on the worker, once."""
    worker = ThreadPoolExecutor(1)
    finished = threading.Event()
    calls: list[int] = []

    class Queued:
        def ready(self) -> bool:
            return False  # the device never answers while the reader waits

        def finish(self) -> int:
            calls.append(1)
            finished.set()
            return 1

    async def main() -> None:
        gen = in_order(_stream([0], []), lambda b: Queued(), worker)
        reading = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading

    asyncio.run(main())
    assert finished.wait(5) and calls == [1]


def test_a_batch_done_when_its_run_returns_takes_one_hand_off_to_the_worker() -> None:
    """On the CPU a Pending is ready the moment ``run`` returns: it is finished in the same
    call on the worker (one hand-off a batch, not two); one still on its device is not."""
    class Counting(ThreadPoolExecutor):
        calls = 0

        def submit(self, fn, /, *args, **kwargs):
            Counting.calls += 1
            return super().submit(fn, *args, **kwargs)

    class Queued:
        def __init__(self, batch: int) -> None:
            self.batch, self.polled = batch, 0

        def ready(self) -> bool:
            self.polled += 1
            return self.batch != 2 or self.polled > 2  # batch 2: its device is still busy

        def finish(self) -> int:
            return self.batch * 10

    async def main() -> list[int]:
        return [r async for r in in_order(_stream([0, 1, 2], []), Queued, Counting(1))]

    assert asyncio.run(main()) == [0, 10, 20]
    assert Counting.calls == 4  # batches 0 and 1 once each, batch 2 started then finished
