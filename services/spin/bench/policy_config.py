"""``spin bench policy``'s configuration, and its one way to send a workload through a router."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import grpc

from loadgen.client import ClientConfig, run_workload
from loadgen.workload import Request

from ..router.config import RouterConfig, SchedulerConfig
from ..zoo.report import family_members
from ..zoo.specs import FAMILY_DIR


@dataclass(frozen=True)
class Sampling:
    """One workload's sampling settings (every configuration of a goodput grid uses them)."""

    name: str
    """``greedy`` or ``sampled``: the report's key."""
    temperature: float = 0.0
    """0 = greedy (outputs lossless-checked against speculation off)."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 = off."""


GREEDY = Sampling("greedy")
SAMPLED = Sampling("sampled", temperature=0.8, top_p=0.95)
"""The README's headline workload: request ``i`` of pass ``r`` samples with seed
``round_seed(seed, r) + i`` in every configuration of that pass."""

ROUND_SEED_STRIDE = 1000
"""Seeds between passes (more than any workload's requests, so no two draws share a seed)."""


def learned_router(policy_config: dict | None = None, cost_model: Path | None = None
                   ) -> RouterConfig:
    """The router of a benchmark that sends the same prompts again (every configuration, pass
    and warm-up of ``spin bench policy``, ``ab`` and ``sweep``): the learned policy with
    ``policy_config``'s overrides, and suffix decoding **off**. Its store would hold the earlier
    outputs of the very prompts being timed and draft a repeated request from them (a greedy
    request's whole output), flattering whichever setting offers it; ``spin bench suffix``
    measures suffix decoding on a workload made for it (as ``grid.py`` does)."""
    return RouterConfig(policy="learned", policy_config=dict(policy_config or {}),
                        cost_model=str(cost_model) if cost_model else None,
                        scheduler=SchedulerConfig(suffix_decoding=False))


def round_seed(seed: int, rnd: int) -> int:
    """The workload seed of pass ``rnd``: a sampled workload draws new outputs each pass. With
    one seed for every pass a fixed configuration replays the same random output each time (its
    drafts and the target's draws are seeded), so a best configuration chosen on some passes
    and timed on another would keep the luck of outputs that happened to accept well, which no
    policy can know in advance."""
    return seed + ROUND_SEED_STRIDE * rnd


@dataclass
class PolicyBenchConfig:
    """What the policy benchmark runs."""

    family_dir: Path = FAMILY_DIR
    quick: bool = False
    """Fewer requests, k values and rates (about 25 minutes on 2 cores)."""
    new_tokens: int = 64
    seed: int = 0
    cost_model: Path | None = None
    """A cost model file for the router (``spin profile``); None: the router fits one from the
    step times the services measure on themselves at start, as in a deployment."""
    workloads: tuple[Sampling, ...] = (GREEDY, SAMPLED)
    """The goodput section's workloads, each over the whole grid."""

    @property
    def requests(self) -> int:
        """Requests of the goodput section (from the evaluation split)."""
        return 9 if self.quick else 24

    @property
    def rounds(self) -> int:
        """Passes over every goodput configuration (per-request medians)."""
        return 2 if self.quick else 3

    @property
    def ks(self) -> tuple[int, ...]:
        """k of the fixed grid: every k the learned policy may choose (``k_max`` 16); --quick
        keeps 8 of them, from 1 to 16."""
        return (1, 2, 3, 4, 6, 8, 12, 16) if self.quick else tuple(range(1, 17))

    @property
    def load_fractions(self) -> tuple[float, ...]:
        """Sweep rates, as fractions of the batched capacity of speculation off."""
        return (0.25, 0.5, 1.0, 2.0) if self.quick else (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0)

    @property
    def pipeline_requests(self) -> int:
        """Concurrent requests of the pipeline section: a full batch (the router's default
        ``max_batch``), the saturated server pipelining is for; two micro-batches of half."""
        return SchedulerConfig().max_batch

    @property
    def sweep_requests(self) -> int:
        """Requests per rate and mode: two full batches (the router's default ``max_batch``),
        so the capacity run and the rates past it keep a queue."""
        return 2 * SchedulerConfig().max_batch

    @property
    def pipeline_drafter(self) -> str:
        """The model drafter of the pipeline section: the family's first (by name)."""
        return family_members(self.family_dir)[0]


def run_requests(endpoint: str, reqs: list[Request], spec: str, k: int, cfg: PolicyBenchConfig,
                 desc: str, concurrency: int | None = 1, progress: bool = True,
                 sampling: Sampling = GREEDY, early_stop: bool = False,
                 rnd: int = 0) -> tuple[list, float]:
    """``reqs`` through the router at ``endpoint`` (``concurrency`` at once; None: at their
    arrival times) with speculation ``spec`` at ``k`` (``early_stop``: its chain may stop early
    as the policy's do), sampling with pass ``rnd``'s seeds (``round_seed``): the results and
    the wall seconds. Raises if any request failed."""
    client = ClientConfig(endpoint, cfg.new_tokens, sampling.temperature,
                          round_seed(cfg.seed, rnd),
                          speculation=spec, k=k, max_concurrency=concurrency,
                          top_p=sampling.top_p, early_stop=early_stop)

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
