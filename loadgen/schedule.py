"""Sending a workload on its arrival schedule, through any backend (gRPC or OpenAI-compatible HTTP).

Requests start at their arrival time (seconds after the run starts), wait for a slot when
``max_concurrency`` is set, and are timed from the moment the call is made (after the slot is
taken, as in ``vllm bench serve``). An error fails only its request; the run goes on. The lossless
check re-runs every prompt without speculation (temperature 0) and compares greedy tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from tqdm import tqdm

from .report import RequestResult
from .workload import Request

if TYPE_CHECKING:
    from .client import ClientConfig


class Backend(Protocol):
    """How one request reaches a server."""

    async def send(self, req: Request, cfg: ClientConfig, suffix: str) -> RequestResult:
        """Send ``req`` (request id suffix ``suffix``) and time its stream; errors are recorded in
        the result, never raised."""

    def finish(self, results: list[RequestResult], requests: Sequence[Request]) -> None:
        """Complete the results of a run after its clock stopped (e.g. count tokens)."""


@dataclass
class RunOutcome:
    """Results of a run and, with the lossless check, of its reference run."""

    results: list[RequestResult]
    """Main run, in workload order."""
    duration_s: float
    """Wall time of the main run."""
    reference: list[RequestResult] | None = None
    """Reference run without speculation (temperature 0), when checked."""


async def send_all(backend: Backend, requests: Sequence[Request], cfg: ClientConfig, desc: str,
                   suffix: str = "", use_arrivals: bool = True,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (on their arrival times unless ``use_arrivals`` is False; a progress bar
    ``desc`` on stderr unless ``progress`` is False).

    Returns the results in workload order (``start_s`` set) and the run's wall time in seconds.
    """
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress)
    t0 = time.perf_counter()

    async def one(req: Request) -> RequestResult:
        if use_arrivals:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        async with sem if sem is not None else contextlib.nullcontext():
            sent = time.perf_counter() - t0
            res = await backend.send(req, cfg, suffix)
        res.start_s = sent
        bar.update(1)
        return res

    try:
        results = list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    backend.finish(results, requests)
    return results, wall


def lossless_mismatches(results: Sequence[RequestResult],
                        reference: Sequence[RequestResult]) -> tuple[int, int]:
    """(requests whose tokens differ from the reference, reference requests that failed).

    Only requests that succeeded in both runs are compared.
    """
    mismatches = sum(1 for a, b in zip(results, reference, strict=True)
                     if a.ok and b.ok and a.token_ids != b.token_ids)
    return mismatches, sum(1 for b in reference if not b.ok)


async def reference_run(backend: Backend, requests: Sequence[Request], cfg: ClientConfig,
                        progress: bool = True) -> list[RequestResult]:
    """Every prompt at once (no arrival schedule, the same concurrency limit) without speculation
    at temperature 0; request ids end in ``-ref``."""
    ref_cfg = dataclasses.replace(cfg, temperature=0.0, speculation="off")
    results, _ = await send_all(backend, requests, ref_cfg, "lossless check", suffix="-ref",
                                use_arrivals=False, progress=progress)
    return results


async def run_with(backend: Backend, cfg: ClientConfig, requests: Sequence[Request],
                   check_lossless: bool = False) -> RunOutcome:
    """Send the workload, and optionally re-run it without speculation as a reference."""
    results, duration = await send_all(backend, requests, cfg, "requests")
    reference = await reference_run(backend, requests, cfg) if check_lossless else None
    return RunOutcome(results, duration, reference)
