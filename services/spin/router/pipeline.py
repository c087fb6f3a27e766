"""Pipelining in the router: micro-batches ("lanes") in flight at once, each in its own loop.

The running requests are split over ``SchedulerConfig.micro_batches`` lanes; each lane runs the
scheduler's step (choose -> draft -> verify -> apply, ``scheduler.py``) over its requests, over
and over, independently of the others. With two lanes, while one waits for the verifier the
other drafts (SPIN's pipeline); with one, the whole batch is drafted, then verified. A request
joins the emptiest lane and stays there until it leaves the batch (finished, failed, preempted).
An empty lane sleeps until a request is placed in it (or the scheduler stops).

The rest of pipelining lives elsewhere: the router writes a lane's batch to a service's stream
while the other lane's batch is still in flight there (``clients.py``), and each service
receives the next batch while it computes the current one (``rpc/batches.py``), so the verifier
starts it without a gap; the learned policy predicts a pipelined step as the longer of drafting
and verification rather than their sum (``ControllerConfig.pipelined``, set by ``server.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from .requests import RouterRequest

Lane = list[RouterRequest]


class Pipeline:
    """The lanes and their loops."""

    def __init__(self, micro_batches: int = 1) -> None:
        self.lanes: list[Lane] = [[] for _ in range(max(1, micro_batches))]
        self._wake = [asyncio.Event() for _ in self.lanes]
        self.stopping = False

    def place(self, req: RouterRequest) -> None:
        """Put a request into the emptiest lane (and wake that lane)."""
        i = min(range(len(self.lanes)), key=lambda j: len(self.lanes[j]))
        self.lanes[i].append(req)
        self._wake[i].set()

    def remove(self, req: RouterRequest) -> None:
        for lane in self.lanes:
            if req in lane:
                lane.remove(req)

    def wake_all(self) -> None:
        for event in self._wake:
            event.set()

    def stop(self) -> None:
        """End every lane's loop after its current step."""
        self.stopping = True
        self.wake_all()

    async def run(self, tidy: Callable[[Lane], None], idle: Callable[[], Awaitable[None]],
                  step: Callable[[Lane], Awaitable[None]]) -> None:
        """Run every lane until ``stop``: before each step ``tidy(lane)`` (drop the cancelled,
        admit waiting requests), then ``step`` over a copy of the lane; an empty lane calls
        ``idle()`` and sleeps until it is woken."""
        await asyncio.gather(*(self._loop(i, tidy, idle, step) for i in range(len(self.lanes))))

    async def _loop(self, i: int, tidy: Callable[[Lane], None],
                    idle: Callable[[], Awaitable[None]],
                    step: Callable[[Lane], Awaitable[None]]) -> None:
        lane, wake = self.lanes[i], self._wake[i]
        while not self.stopping:
            tidy(lane)
            if not lane:
                await idle()
                wake.clear()
                if not lane and not self.stopping:  # a request may have come during idle()
                    await wake.wait()
                continue
            await step(list(lane))
