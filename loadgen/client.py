"""Async gRPC client of the router: every request one ``Generation.Generate`` server stream.

The schedule (arrival times, concurrency limit, the lossless reference run) is ``schedule.py``'s,
shared with the OpenAI-compatible HTTP backend (``openai_client.py``). A gRPC error of any status
fails only that request; the run goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from spin.rpc import credentials
from spin.v1 import generation_pb2, generation_pb2_grpc, sampling_pb2

from .report import DrafterCounts, RequestResult, SpecCounts
from .schedule import RunOutcome, lossless_mismatches, run_with, send_all
from .workload import Request

__all__ = ["ClientConfig", "EndpointUnreachable", "GrpcBackend", "RunOutcome", "connect",
           "lossless_mismatches", "make_request", "run", "run_workload", "send_one",
           "speculation_message"]


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
    except TimeoutError:
        raise EndpointUnreachable(endpoint) from None


class GrpcBackend:
    """Requests as ``Generation.Generate`` streams of one channel (``schedule.Backend``)."""

    def __init__(self, stub: generation_pb2_grpc.GenerationStub, api_key: str | None) -> None:
        self.stub = stub
        self.metadata = credentials.metadata(api_key)

    async def send(self, req: Request, cfg: ClientConfig, suffix: str) -> RequestResult:
        return await send_one(self.stub, req.index, make_request(cfg, req, suffix), cfg.timeout_s,
                              self.metadata)

    def finish(self, results: list[RequestResult], requests: Sequence[Request]) -> None:
        """Nothing to do: the stream carried the token ids and the usage."""


async def run_workload(stub: generation_pb2_grpc.GenerationStub, requests: Sequence[Request],
                       cfg: ClientConfig, desc: str, suffix: str = "",
                       use_arrivals: bool = True,
                       progress: bool = True) -> tuple[list[RequestResult], float]:
    """``schedule.send_all`` through ``stub``: the results in workload order and the wall time."""
    return await send_all(GrpcBackend(stub, cfg.api_key), requests, cfg, desc, suffix,
                          use_arrivals, progress)


@contextlib.asynccontextmanager
async def connect(cfg: ClientConfig, connect_timeout_s: float = 10.0) -> AsyncIterator[GrpcBackend]:
    """A backend on a channel to ``cfg.endpoint`` once it is ready (else
    ``EndpointUnreachable``)."""
    async with credentials.aio_channel(cfg.endpoint, cfg.tls_ca) as channel:
        await wait_ready(channel, cfg.endpoint, connect_timeout_s)
        yield GrpcBackend(generation_pb2_grpc.GenerationStub(channel), cfg.api_key)


async def run(cfg: ClientConfig, requests: Sequence[Request], check_lossless: bool = False,
              connect_timeout_s: float = 10.0) -> RunOutcome:
    """Connect, send the workload, and optionally re-run it without speculation as a reference.

    The reference run sends every prompt at once (no arrival schedule) under the same concurrency
    limit; its request ids end in ``-ref``.
    """
    async with connect(cfg, connect_timeout_s) as backend:
        return await run_with(backend, cfg, requests, check_lossless)
