"""OpenTelemetry tracing: ``spin.obs.tracing`` alone, then one request's trace across the embedded
deployment's processes, caught by an OTLP/gRPC receiver running in the test.

The deployment runs the router, one model drafter (draft-code) and the verifier with Redis, all
exporting to the receiver; it is stopped before the assertions, so every span has been flushed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import secrets
import threading
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from service_helpers import request

from spin.obs import tracing
from spin.router.config import RouterConfig
from spin.serve import Embedded, ServeConfig
from spin.v1 import generation_pb2, generation_pb2_grpc

DRAFTER = "draft-code"
PROMPT = "def read_config(path):\n    with open(path) as f:\n"
SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


# ---- an OTLP/gRPC receiver ----------------------------------------------------------------------
@dataclass
class Span:
    """One exported span, flattened."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    attributes: dict[str, Any]
    links: list[tuple[str, str]] = field(default_factory=list)


def _value(v) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects what the services export (``ExportTraceServiceRequest``s)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request, context):
        with self._lock:
            self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[Span]:
        out = []
        with self._lock:
            requests = list(self.requests)
        for req in requests:
            for rs in req.resource_spans:
                res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        out.append(Span(res.get("service.name", ""), s.name, s.trace_id.hex(),
                                        s.span_id.hex(), s.parent_span_id.hex(), s.kind,
                                        {kv.key: _value(kv.value) for kv in s.attributes},
                                        [(ln.trace_id.hex(), ln.span_id.hex()) for ln in s.links]))
        return out


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    server = grpc.server(futures.ThreadPoolExecutor(4))
    rec = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield rec, port
    server.stop(None)


def _ancestors(span: Span, by_id: dict[str, Span]) -> list[Span]:
    chain = []
    while span.parent_id in by_id:
        span = by_id[span.parent_id]
        chain.append(span)
    return chain


def _cancel_after_first_tokens(endpoint: str, req: generation_pb2.GenerateRequest) -> None:
    """The client gives up once the first step's tokens arrive."""
    with grpc.insecure_channel(endpoint) as ch:
        call = generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120)
        with pytest.raises(grpc.RpcError) as cancelled:
            for _ in call:
                call.cancel()
        assert cancelled.value.code() == grpc.StatusCode.CANCELLED


def _generate(endpoint: str, req: generation_pb2.GenerateRequest,
              traceparent: str | None = None) -> tuple[list[int], generation_pb2.GenerateResponse]:
    metadata = [("traceparent", traceparent)] if traceparent else None
    with grpc.insecure_channel(endpoint) as ch:
        ids, last = [], None
        for msg in generation_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120,
                                                                    metadata=metadata):
            ids += msg.token_ids
            last = msg
    return ids, last


def _embedded(log_dir: Path, port: int, **env: str) -> Embedded:
    """Router, draft-code, verifier and Redis exporting to the receiver on ``port``; the fixed
    policy sends requests in mode auto to draft-code too."""
    return Embedded(ServeConfig(
        port=0, drafters=[DRAFTER],
        router=RouterConfig(policy="fixed", default_drafter=DRAFTER, default_k=3),
        log_dir=log_dir, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
                              "OTEL_BSP_SCHEDULE_DELAY": "200", **env}))


# ---- the deployment, traced ---------------------------------------------------------------------
@dataclass
class Run:
    spans: list[Span]
    drafter_rid: str
    drafter_trace: str
    client_span: str
    drafter_last: generation_pb2.GenerateResponse
    drafter_ids: list[int]
    auto_rid: str
    auto_last: generation_pb2.GenerateResponse
    router_log: str


@pytest.fixture(scope="module")
def traced(receiver, tmp_path_factory: pytest.TempPathFactory) -> Run:
    rec, port = receiver
    emb = _embedded(tmp_path_factory.mktemp("serve-traced"), port,
                    OTEL_TRACES_SAMPLER="parentbased_traceidratio", OTEL_TRACES_SAMPLER_ARG="1.0")
    emb.start()
    try:
        assert emb.redis is not None, "the tracing test needs redis-server (make test installs it)"
        trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
        ids, last = _generate(emb.endpoint, request(PROMPT, max_tokens=24, mode="drafter",
                                                    drafter=DRAFTER, k=3, ignore_eos=True,
                                                    request_id="traced-drafter"),
                              traceparent=f"00-{trace_id}-{client_span}-01")
        _, auto_last = _generate(emb.endpoint, request(PROMPT, max_tokens=16, ignore_eos=True,
                                                       request_id="traced-auto"))
        _cancel_after_first_tokens(emb.endpoint, request(PROMPT, max_tokens=400, ignore_eos=True,
                                                         request_id="traced-cancelled"))
        router_log = emb.router.log_path
    finally:
        emb.stop()  # SIGTERM: each process exports what it buffered before it exits
    return Run(rec.spans(), "traced-drafter", trace_id, client_span, last, ids, "traced-auto",
               auto_last, router_log.read_text())


def test_a_request_trace_spans_router_drafter_and_verifier(traced: Run) -> None:
    assert traced.drafter_last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    spans = [s for s in traced.spans if s.trace_id == traced.drafter_trace]
    assert {s.service for s in spans} >= {"spin-router", f"spin-drafter-{DRAFTER}", "spin-verifier"}
    by_id = {s.span_id: s for s in spans}
    # the client's traceparent (gRPC metadata) -> the gRPC server span -> spin.generate
    server = [s for s in spans if s.name == "/spin.v1.Generation/Generate"]
    assert len(server) == 1 and server[0].kind == SERVER_KIND
    assert server[0].service == "spin-router" and server[0].parent_id == traced.client_span
    (generate,) = [s for s in spans if s.name == "spin.generate"]
    assert generate.service == "spin-router" and generate.parent_id == server[0].span_id
    assert generate.attributes["spin.request_id"] == traced.drafter_rid
    assert generate.attributes["spin.mode"] == "drafter"
    assert generate.attributes["spin.prompt_tokens"] > 0
    assert generate.attributes["spin.max_tokens"] == 24
    assert generate.attributes["spin.completion_tokens"] == len(traced.drafter_ids) == 24
    assert generate.attributes["spin.finish_reason"] == "length"
    spec = traced.drafter_last.speculation
    assert generate.attributes["spin.steps"] == spec.steps
    assert generate.attributes["spin.tau"] == pytest.approx(spec.tau)
    # every draft and verify span descends from this request's spin.generate via a spin.step
    drafts = [s for s in spans if s.name == "spin.draft"]
    verifies = [s for s in spans if s.name == "spin.verify"]
    steps = [s for s in spans if s.name == "spin.step"]
    assert drafts and verifies and steps
    for s in drafts + verifies:
        chain = _ancestors(s, by_id)
        assert chain[0].name == "spin.step" and chain[0].service == "spin-router"
        assert generate in chain, f"{s.name} does not descend from spin.generate"
        assert s.attributes["spin.request_id"] == traced.drafter_rid
        assert s.kind == SERVER_KIND
    assert all(s.service == f"spin-drafter-{DRAFTER}" for s in drafts)
    assert all(s.service == "spin-verifier" for s in verifies)
    assert all(s.parent_id == generate.span_id for s in steps)
    # the spans add up to what the client was told
    assert len(verifies) == spec.steps
    assert sum(s.attributes["spin.accepted"] for s in verifies) == spec.accepted_tokens
    assert sum(s.attributes["spin.tree_size"] for s in drafts) == spec.draft_tokens
    assert sum(s.attributes["spin.accepted"] for s in steps) == spec.accepted_tokens
    # the policy drafts while more than one token remains; the last steps go without a draft
    drafted = [s for s in steps if s.attributes["spin.drafter"] == DRAFTER]
    assert drafted and len(drafted) == len(drafts)
    assert all(s.attributes["spin.drafter"] == "" for s in steps if s not in drafted)
    assert all(s.attributes["spin.k"] == 3 for s in drafts)


def test_auto_mode_request_gets_its_own_trace(traced: Run) -> None:
    assert traced.auto_last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    (generate,) = [s for s in traced.spans if s.name == "spin.generate"
                   and s.attributes["spin.request_id"] == traced.auto_rid]
    assert generate.trace_id != traced.drafter_trace
    assert generate.attributes["spin.mode"] == "auto"
    spans = [s for s in traced.spans if s.trace_id == generate.trace_id]
    by_id = {s.span_id: s for s in spans}
    root = _ancestors(generate, by_id)[-1]
    assert root.name == "/spin.v1.Generation/Generate" and root.parent_id == ""
    for name, service in (("spin.draft", f"spin-drafter-{DRAFTER}"),
                          ("spin.verify", "spin-verifier")):
        found = [s for s in spans if s.name == name]
        assert found and all(s.service == service for s in found)
        assert all(generate in _ancestors(s, by_id) for s in found)
        assert all(s.attributes["spin.request_id"] == traced.auto_rid for s in found)


def test_a_cancelled_request_ends_its_trace(traced: Run) -> None:
    (generate,) = [s for s in traced.spans if s.name == "spin.generate"
                   and s.attributes["spin.request_id"] == "traced-cancelled"]
    assert generate.attributes["spin.cancelled"] is True
    assert "spin.finish_reason" not in generate.attributes
    (server,) = [s for s in traced.spans if s.span_id == generate.parent_id]
    assert server.name == "/spin.v1.Generation/Generate"
    for name in ("spin.step", "spin.draft", "spin.verify"):  # it ran a few steps first
        assert [s for s in traced.spans if s.name == name and s.trace_id == generate.trace_id]
    # the gRPC instrumentation's context handling survives the cancelled stream
    assert "Traceback" not in traced.router_log and "detach" not in traced.router_log


def test_batch_spans_link_their_tasks(traced: Run) -> None:
    by_id = {s.span_id: s for s in traced.spans}
    for task_name, batch_name in (("spin.draft", "spin.drafter.speculate"),
                                  ("spin.verify", "spin.verifier.verify")):
        tasks = [s for s in traced.spans if s.name == task_name]
        assert tasks
        for t in tasks:
            (link,) = t.links
            batch = by_id[link[1]]
            assert batch.name == batch_name and batch.service == t.service
            assert batch.parent_id == "" and batch.trace_id != t.trace_id  # its own trace
            assert (t.trace_id, t.parent_id) in batch.links  # ... listing the tasks' steps
            assert batch.attributes["spin.batch_id"] == t.attributes["spin.batch_id"]


def test_grpc_and_redis_instrumentation(traced: Run) -> None:
    names = {(s.service, s.name) for s in traced.spans}
    # unary calls are instrumented (the router asks each service what it serves at start) ...
    assert (f"spin-drafter-{DRAFTER}", "/spin.v1.Drafter/GetDrafterInfo") in names
    assert ("spin-verifier", "/spin.v1.Verifier/GetVerifierInfo") in names
    # ... the long-lived batch streams, health checks and reflection are not
    assert not [n for _, n in names if n.endswith(("/Speculate", "/Verify"))
                or n.startswith("/grpc.")]
    # the router's statistics store writes to Redis after speculative steps
    redis = [s for s in traced.spans if s.service == "spin-router"
             and "redis" in (s.attributes.get("db.system"), s.attributes.get("db.system.name"))]
    assert redis, "no Redis spans from the router"


def test_sampler_ratio_zero_exports_nothing(receiver, tmp_path: Path) -> None:
    """Ratio 0: requests succeed and export nothing, though tracing is on: a request the client
    sampled itself (parent-based sampling) is still traced, and is all that is exported."""
    rec, port = receiver
    before = len(rec.spans())
    emb = _embedded(tmp_path, port, OTEL_TRACES_SAMPLER="parentbased_traceidratio",
                    OTEL_TRACES_SAMPLER_ARG="0")
    emb.start()
    client_trace = secrets.token_hex(16)
    try:
        ids, last = _generate(emb.endpoint, request(PROMPT, max_tokens=16, mode="drafter",
                                                    drafter=DRAFTER, k=3, ignore_eos=True))
        _, auto = _generate(emb.endpoint, request(PROMPT, max_tokens=16, ignore_eos=True))
        _, sampled = _generate(emb.endpoint, request(PROMPT, max_tokens=8, ignore_eos=True),
                               traceparent=f"00-{client_trace}-{secrets.token_hex(8)}-01")
    finally:
        emb.stop()
    assert len(ids) == 16 and last.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    assert last.speculation.draft_tokens > 0  # the drafter really ran
    assert auto.finish_reason == sampled.finish_reason == generation_pb2.FINISH_REASON_LENGTH
    spans = rec.spans()[before:]
    assert {s.trace_id for s in spans} == {client_trace}, "spans exported with sampling ratio 0"
    assert {s.service for s in spans} == {"spin-router", f"spin-drafter-{DRAFTER}",
                                          "spin-verifier"}


# ---- spin.obs.tracing in this process ----------------------------------------------------------
@pytest.fixture()
def memory(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on in this process (an endpoint that nothing reads), spans kept in memory."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for name in ("OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(name, raising=False)
    exporter = InMemorySpanExporter()
    yield exporter
    tracing.shutdown()


def _router_request(rid: str = "r1") -> SimpleNamespace:
    params = SimpleNamespace(max_tokens=8, mode="drafter", drafter="d", k=2)
    return SimpleNamespace(request_id=rid, prompt=(1, 2, 3), params=params, trace=None)


def test_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in tracing.ENDPOINT_VARS:
        monkeypatch.delenv(name, raising=False)
    assert not tracing.configured()
    assert tracing.setup("spin-test", exporter=InMemorySpanExporter()) is False
    assert not tracing.enabled()
    assert isinstance(tracing.tracer(), trace.NoOpTracer)
    assert tracing.RequestTrace.start(_router_request()) is None
    assert tracing.server_interceptors(["spin.v1.Generation"]) == []
    assert not tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                   "OTEL_SDK_DISABLED": "true"})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"})


def test_traceparent_round_trip() -> None:
    ctx = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=False,
                      trace_flags=TraceFlags(TraceFlags.SAMPLED),
                      trace_state=trace.TraceState([("vendor", "x")]))
    traceparent, tracestate = tracing.inject(NonRecordingSpan(ctx))
    assert traceparent == "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert tracestate == "vendor=x"
    back = trace.get_current_span(tracing.extract(traceparent, tracestate)).get_span_context()
    assert (back.trace_id, back.span_id, back.trace_flags.sampled) == (ctx.trace_id, ctx.span_id,
                                                                       True)
    assert back.is_remote and back.trace_state.get("vendor") == "x"
    unsampled = SpanContext(ctx.trace_id, ctx.span_id, is_remote=False)
    assert tracing.inject(NonRecordingSpan(unsampled)) == ("", "")
    assert tracing.extract("") is None
    assert tracing.extract("00-not-a-traceparent-01") is None


def test_router_step_is_the_parent_of_service_task_spans(memory: InMemorySpanExporter) -> None:
    assert tracing.setup("spin-test", exporter=memory)
    req = _router_request()
    req.trace = tracing.RequestTrace.start(req)
    assert req.trace is not None
    tracing.start_steps([req], [SimpleNamespace(drafter="d", k=2)])
    tp, ts = req.trace.traceparent, req.trace.tracestate
    version, trace_id, span_id, flags = tp.split("-")
    assert version == "00" and len(trace_id) == 32 and len(span_id) == 16
    assert int(flags, 16) & 1  # sampled
    tracing.record_batch("spin.verifier.verify", "spin.verify", 1, 2, {"spin.batch_id": 7},
                         [(tp, ts, {"spin.request_id": "r1"}), ("", "", {"untraced": True})])
    tracing.end_step(req, SimpleNamespace(drafter="d"), 2,
                     SimpleNamespace(num_accepted=1, resync=False))
    req.trace.end()
    tracing.shutdown()
    spans = {s.name: s for s in memory.get_finished_spans()}
    assert set(spans) == {"spin.generate", "spin.step", "spin.verify", "spin.verifier.verify"}
    gen, step, task, batch = (spans[n] for n in ("spin.generate", "spin.step", "spin.verify",
                                                  "spin.verifier.verify"))
    assert gen.resource.attributes["service.name"] == "spin-test"
    assert step.parent.span_id == gen.context.span_id
    assert task.parent.span_id == step.context.span_id
    assert task.context.trace_id == gen.context.trace_id
    assert task.attributes["spin.request_id"] == "r1"
    assert batch.parent is None and [ln.context.span_id for ln in batch.links] == [
        step.context.span_id]
    assert [ln.context.span_id for ln in task.links] == [batch.context.span_id]
    assert step.attributes["spin.accepted"] == 1 and gen.attributes["spin.cancelled"] is True


def test_request_span_takes_the_outcome_of_the_plain_stream(
        memory: InMemorySpanExporter) -> None:
    """The router's stream events (``router/streaming.py``): the last chunk's totals, or the
    error status a ``RequestError`` maps to."""
    from spin.router.accounting import StepInfo
    from spin.router.streaming import Chunk, DrafterUsage, SpeculationStats, Usage

    assert tracing.setup("spin-test", exporter=memory)
    step = StepInfo("d", 2, 2, 1, 0.01, 0.0, 1)
    done, failed = _router_request("done"), _router_request("failed")
    done.trace, failed.trace = tracing.RequestTrace.start(done), tracing.RequestTrace.start(failed)
    done.trace.observe(Chunk("done", [4, 5], "45", step))  # not the last: nothing yet
    done.trace.observe(Chunk("done", [6], "6", step, "length", Usage(3, 3),
                             SpeculationStats(2, 1, 2, 1, 1.5, (DrafterUsage("d", 1, 2, 1),))))
    failed.trace.fail(grpc.StatusCode.UNAVAILABLE, "verifier unreachable")
    done.trace.end()
    failed.trace.end()
    tracing.shutdown()
    spans = {s.attributes["spin.request_id"]: s for s in memory.get_finished_spans()}
    ok, bad = spans["done"], spans["failed"]
    assert ok.attributes["spin.finish_reason"] == "length"
    assert (ok.attributes["spin.completion_tokens"], ok.attributes["spin.steps"],
            ok.attributes["spin.steps_without_speculation"], ok.attributes["spin.tau"]) == (
        3, 2, 1, 1.5)
    assert "spin.cancelled" not in ok.attributes and ok.status.is_ok
    assert bad.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert bad.status.description == "UNAVAILABLE: verifier unreachable"
    assert "spin.cancelled" not in bad.attributes


def test_service_name_from_the_environment(memory: InMemorySpanExporter,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "my-router")
    assert tracing.setup("spin-router", exporter=memory)
    tracing.tracer().start_span("x").end()
    tracing.shutdown()
    (span,) = memory.get_finished_spans()
    assert span.resource.attributes["service.name"] == "my-router"


def test_ratio_zero_samples_no_request(memory: InMemorySpanExporter,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0")
    assert tracing.setup("spin-test", exporter=memory)
    req = _router_request()
    assert tracing.RequestTrace.start(req) is None  # not sampled: no spans, no traceparent
    tracing.start_steps([req], [SimpleNamespace(drafter="d", k=2)])
    assert req.trace is None
    tracing.tracer().start_span("root").end()
    tracing.shutdown()
    assert memory.get_finished_spans() == ()


class _Endless(generation_pb2_grpc.GenerationServicer):
    """Streams responses until the client goes away; ``max_tokens`` 0 is refused."""

    def __init__(self) -> None:
        self.closed = 0

    async def Generate(self, request, context):
        if request.max_tokens == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be > 0")
        try:
            for i in range(request.max_tokens):
                await asyncio.sleep(0)
                yield generation_pb2.GenerateResponse(text=str(i))
        finally:
            self.closed += 1


def test_a_cancelled_stream_closes_its_span_in_its_own_call(
        memory: InMemorySpanExporter, caplog: pytest.LogCaptureFixture) -> None:
    """A client that cancels while responses are being written: the handler's generator and the
    server span end with the call, not later in another task ("Failed to detach context")."""
    assert tracing.setup("spin-test", exporter=memory)
    servicer = _Endless()
    cancelled = 30

    async def run() -> list:
        server = grpc.aio.server(interceptors=tracing.server_interceptors(["spin.v1.Generation"]))
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                full = [r.text async for r in stub.Generate(
                    generation_pb2.GenerateRequest(max_tokens=5))]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Generate(generation_pb2.GenerateRequest(max_tokens=0)).read()
                for n in range(cancelled):
                    call = stub.Generate(generation_pb2.GenerateRequest(max_tokens=10**6))
                    for _ in range(3 + n % 5):
                        await call.read()
                    call.cancel()
                for _ in range(200):  # the server learns of the cancellations asynchronously
                    if servicer.closed == cancelled + 1:
                        break
                    await asyncio.sleep(0.01)
            return [full, refused.value]
        finally:
            await server.stop(None)

    with caplog.at_level(logging.WARNING):
        full, refused = asyncio.run(run())
        gc.collect()
    assert full == ["0", "1", "2", "3", "4"]
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "max_tokens must be > 0"
    assert servicer.closed == cancelled + 1  # every started stream ran its finally
    assert not [r for r in caplog.records if "detach" in r.getMessage()]
    tracing.shutdown()
    spans = [s for s in memory.get_finished_spans() if s.name == "/spin.v1.Generation/Generate"]
    assert len(spans) == cancelled + 2
