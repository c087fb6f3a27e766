"""Async gRPC client of the router: sends a workload on its arrival schedule and times every stream.

Each request is one ``Generation.Generate`` server stream. Requests start at their arrival time
(seconds after the run starts), wait for a slot when ``max_concurrency`` is set, and are timed from
the moment the call is made (after the slot is taken, as in ``vllm bench serve``). A gRPC error of
any status fails only that request; the run goes on.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from tqdm import tqdm

from spin.rpc import credentials
from spin.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

from .report import DrafterCounts, RequestResult, SpecCounts
from .workload import Request


class EndpointUnreachable(Exception):
    """The router did not become ready within the connect timeout."""


@dataclass(frozen=True)
class ClientConfig:
    """How every request of a run is sent."""

    endpoint: str
    """Router address, ``host:port``."""
    max_tokens: int
    """Tokens to generate per request."""
    temperature: float = 0.0
    """Sampling temperature; 0 = greedy."""
    seed: int = 0
    """Workload seed; request ``i`` samples with seed ``seed + i`` when temperature > 0."""
    speculation: str = "auto"
    """``auto``, ``off`` or a drafter name."""
    k: int = 0
    """Speculation length with a named drafter (0 = the router's choice)."""
    ignore_eos: bool = True
    """Generate exactly ``max_tokens`` (do not stop at end-of-sequence)."""
    max_concurrency: int | None = None
    """Requests in flight at most; None = unlimited."""
    timeout_s: float = 300.0
    """Deadline of one request."""
    api_key: str | None = None
    """The router's API key (None: none)."""
    tls_ca: str | None = None
    """Connect over TLS, trusting this CA file ('' = the system's roots); None: plaintext."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    early_stop: bool = False
    """With a named drafter and k: its chain stops early as the policy's do
    (``Speculation.early_stop``)."""


def speculation_message(spec: str, k: int = 0,
                        early_stop: bool = False) -> generation_pb2.Speculation:
    """``auto`` / ``off`` / drafter name (with its k) -> a ``Speculation`` message."""
    if spec == "auto":
        return generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_AUTO)
    if spec == "off":
        return generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_OFF)
    return generation_pb2.Speculation(mode=generation_pb2.SPECULATION_MODE_DRAFTER, drafter=spec,
                                      k=k, early_stop=early_stop)


def make_request(cfg: ClientConfig, req: Request, suffix: str = "") -> generation_pb2.GenerateRequest:
    """The ``GenerateRequest`` of one workload request."""
    sampling = sampling_pb2.SamplingParams(temperature=cfg.temperature)
    if cfg.top_p != 1.0:
        sampling.top_p = cfg.top_p
    if cfg.temperature > 0:
        sampling.seed = cfg.seed + req.index
    return generation_pb2.GenerateRequest(
        request_id=f"loadgen-{cfg.seed}-{req.index}{suffix}", prompt=req.prompt,
        max_tokens=cfg.max_tokens, sampling=sampling,
        speculation=speculation_message(cfg.speculation, cfg.k, cfg.early_stop),
        ignore_eos=cfg.ignore_eos)


def _spec_counts(s: generation_pb2.SpeculationStats) -> SpecCounts:
    return SpecCounts(
        steps=s.steps, steps_without_speculation=s.steps_without_speculation,
        draft_tokens=s.draft_tokens, accepted_tokens=s.accepted_tokens,
        drafters={d.drafter: DrafterCounts(d.steps, d.draft_tokens, d.accepted_tokens)
                  for d in s.drafters})


async def send_one(stub: generation_pb2_grpc.GenerationStub, index: int,
                   greq: generation_pb2.GenerateRequest, timeout_s: float,
                   metadata: tuple[tuple[str, str], ...] = ()) -> RequestResult:
    """Send one request and time its stream; errors are recorded, never raised."""
    res = RequestResult(index=index)
    start = time.perf_counter()
    last_token_at: float | None = None
    try:
        async for msg in stub.Generate(greq, timeout=timeout_s, metadata=metadata):
            now = time.perf_counter()
            if msg.token_ids:
                if last_token_at is None:
                    res.ttft_s = now - start
                else:
                    res.itls_s.append(now - last_token_at)
                last_token_at = now
                res.token_ids.extend(msg.token_ids)
            if msg.finish_reason != generation_pb2.FINISH_REASON_UNSPECIFIED:
                res.e2e_s = now - start
                res.prompt_tokens = msg.usage.prompt_tokens
                res.speculation = _spec_counts(msg.speculation)
                res.ok = True
        if not res.ok:
            res.error_code = "INCOMPLETE_STREAM"
            res.error_message = "the stream ended without a finish reason"
    except grpc.aio.AioRpcError as e:
        res.ok = False
        res.error_code = e.code().name
        res.error_message = e.details() or ""
    return res


async def wait_ready(channel: grpc.aio.Channel, endpoint: str, timeout_s: float) -> None:
    """Wait until the channel connects, or raise ``EndpointUnreachable``."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout_s)
    except asyncio.TimeoutError:
        raise EndpointUnreachable(endpoint) from None


async def run_workload(stub: generation_pb2_grpc.GenerationStub, requests: Sequence[Request],
                       cfg: ClientConfig, desc: str, suffix: str = "",
                       use_arrivals: bool = True,
                       progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send ``requests`` (on their arrival times unless ``use_arrivals`` is False; a progress bar
    on stderr unless ``progress`` is False).

    Returns the results in workload order and the run's wall time in seconds.
    """
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", file=sys.stderr, disable=not progress)
    t0 = time.perf_counter()

    async def one(req: Request) -> RequestResult:
        if use_arrivals:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        greq = make_request(cfg, req, suffix)
        auth = credentials.metadata(cfg.api_key)
        if sem is None:
            res = await send_one(stub, req.index, greq, cfg.timeout_s, auth)
        else:
            async with sem:
                res = await send_one(stub, req.index, greq, cfg.timeout_s, auth)
        bar.update(1)
        return res

    try:
        results = await asyncio.gather(*(one(r) for r in requests))
    finally:
        bar.close()
    return list(results), time.perf_counter() - t0


@dataclass
class RunOutcome:
    """Results of a run and, with the lossless check, of its reference run."""

    results: list[RequestResult]
    """Main run, in workload order."""
    duration_s: float
    """Wall time of the main run."""
    reference: list[RequestResult] | None = None
    """Reference run without speculation (temperature 0), when checked."""


def lossless_mismatches(results: Sequence[RequestResult],
                        reference: Sequence[RequestResult]) -> tuple[int, int]:
    """(requests whose tokens differ from the reference, reference requests that failed).

    Only requests that succeeded in both runs are compared.
    """
    mismatches = sum(1 for a, b in zip(results, reference, strict=True)
                     if a.ok and b.ok and a.token_ids != b.token_ids)
    return mismatches, sum(1 for b in reference if not b.ok)


async def run(cfg: ClientConfig, requests: Sequence[Request], check_lossless: bool = False,
              connect_timeout_s: float = 10.0) -> RunOutcome:
    """Connect, send the workload, and optionally re-run it without speculation as a reference.

    The reference run sends every prompt at once (no arrival schedule) under the same concurrency
    limit; its request ids end in ``-ref``.
    """
    async with credentials.aio_channel(cfg.endpoint, cfg.tls_ca) as channel:
        await wait_ready(channel, cfg.endpoint, connect_timeout_s)
        stub = generation_pb2_grpc.GenerationStub(channel)
        results, duration = await run_workload(stub, requests, cfg, "requests")
        reference = None
        if check_lossless:
            ref_cfg = dataclasses.replace(cfg, temperature=0.0, speculation="off")
            reference, _ = await run_workload(stub, requests, ref_cfg, "lossless check",
                                              suffix="-ref", use_arrivals=False)
        return RunOutcome(results, duration, reference)
