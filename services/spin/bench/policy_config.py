"""``spin bench policy``'s configuration, and its one way to send a workload through a router."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc

from loadgen.client import ClientConfig, run_workload
from loadgen.workload import Request

from ..router.config import SchedulerConfig
from ..zoo.specs import FAMILY_DIR


@dataclass
class PolicyBenchConfig:
    """What the policy benchmark runs."""

    family_dir: Path = FAMILY_DIR
    quick: bool = False
    """Fewer requests, k values and rates (at most 12 minutes on 2 cores)."""
    new_tokens: int = 64
    seed: int = 0
    cost_model: Path | None = None
    """A cost model file for the router (``spin profile``); None: the router fits one from the
    step times the services measure on themselves at start, as in a deployment."""

    @property
    def requests(self) -> int:
        return 9 if self.quick else 24

    @property
    def rounds(self) -> int:
        """Passes over every goodput configuration (per-request medians)."""
        return 2 if self.quick else 3

    @property
    def ks(self) -> tuple[int, ...]:
        return (2, 4) if self.quick else (2, 4, 6)

    @property
    def load_fractions(self) -> tuple[float, ...]:
        return (0.1, 0.5, 1.0) if self.quick else (0.1, 0.3, 0.6, 1.0, 1.5)

    @property
    def pipeline_requests(self) -> int:
        """Concurrent requests of the pipeline section: a full batch (the router's default
        ``max_batch``), the saturated server pipelining is for; two micro-batches of half."""
        return SchedulerConfig().max_batch

    @property
    def sweep_requests(self) -> int:
        """Requests per rate and configuration (at 0.1 of capacity, 6 take about a minute)."""
        return 6 if self.quick else 24


def run_requests(endpoint: str, reqs: list[Request], spec: str, k: int, cfg: PolicyBenchConfig,
                 desc: str, concurrency: int | None = 1,
                 progress: bool = True) -> tuple[list, float]:
    """``reqs`` through the router at ``endpoint`` (``concurrency`` at once; None: at their
    arrival times) with speculation ``spec`` at ``k``: the results and the wall seconds. Raises
    if any request failed."""
    client = ClientConfig(endpoint, cfg.new_tokens, speculation=spec, k=k,
                          max_concurrency=concurrency)

    async def go():
        async with grpc.aio.insecure_channel(endpoint) as channel:
            from spin.v1 import generation_pb2_grpc
            return await run_workload(generation_pb2_grpc.GenerationStub(channel), reqs, client,
                                      desc, use_arrivals=concurrency is None,
                                      progress=progress)
    results, wall = asyncio.run(go())
    failed = [r for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{desc}: {len(failed)} requests failed, e.g. {failed[0].error_message}")
    return results, wall
