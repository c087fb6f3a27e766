"""The router's ``Frontend`` in process, over a stand-in scheduler: plain requests in, its own
error kinds out, which each adapter maps (gRPC status codes; HTTP statuses), and no wire
protocol in it or on the HTTP path."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spin.obs import tracing
from spin.openai_api.app import HTTP_STATUS
from spin.router.frontend import ErrorKind, Frontend, RequestFailed
from spin.router.scheduler import QueueFull
from spin.router.server import status
from spin.router.streaming import RequestError
from spin.router.validation import ClientRequest, SpeculationRequest

SERVICES = Path(__file__).resolve().parents[2] / "services" / "spin"


class Tokenizer:
    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [ord(c) % 100 for c in text]}


class Scheduler:
    """What ``Frontend`` uses of the scheduler: its proposers' names, submit and cancel."""

    def __init__(self, room: int = 8) -> None:
        self.proposers = {"prompt-lookup": None, "draft-code": None}
        self.room = room
        self.submitted: list = []
        self.cancelled: list = []

    def submit(self, req) -> None:
        if len(self.submitted) >= self.room:
            raise QueueFull(f"{len(self.submitted)} requests are waiting (limit {self.room})")
        self.submitted.append(req)

    def cancel(self, req) -> None:
        self.cancelled.append(req)


def frontend(room: int = 8) -> Frontend:
    return Frontend(Scheduler(room), Tokenizer(), max_context=64, vocab_size=100)


def test_a_plain_request_is_validated_and_admitted() -> None:
    fe = frontend()
    req = fe.submit(ClientRequest(prompt="hi", max_tokens=3, request_id="a",
                                  speculation=SpeculationRequest("drafter", "draft-code", 2)))
    assert fe.scheduler.submitted == [req]
    assert (req.request_id, req.prompt, req.params.drafter, req.params.k) == (
        "a", (ord("h") % 100, ord("i") % 100), "draft-code", 2)
    assert fe.drafter_names == {"prompt-lookup", "draft-code"}


def test_refusals_are_the_frontends_own_error_kinds() -> None:
    fe = frontend(room=1)
    with pytest.raises(RequestFailed) as e:
        fe.submit(ClientRequest(prompt="hi", max_tokens=0))
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT
    assert "max_tokens must be > 0" in e.value.message
    fe.submit(ClientRequest(prompt="hi", max_tokens=3, request_id="a"))
    with pytest.raises(RequestFailed, match="in use by a running request") as e:
        fe.submit(ClientRequest(prompt="hi", max_tokens=3, request_id="a"))
    assert e.value.kind is ErrorKind.INVALID_ARGUMENT
    with pytest.raises(RequestFailed, match="limit 1") as e:
        fe.submit(ClientRequest(prompt="hi", max_tokens=3, request_id="b"))
    assert e.value.kind is ErrorKind.RESOURCE_EXHAUSTED


def test_a_failure_while_running_ends_the_events_and_cancels() -> None:
    fe = frontend()
    req = fe.submit(ClientRequest(prompt="hi", max_tokens=3))
    req.out.put_nowait(RequestError("unavailable", "no verifier for 30 s"))

    async def drain() -> None:
        async for _ in fe.events(req):
            pass

    with pytest.raises(RequestFailed, match="no verifier") as e:
        asyncio.run(drain())
    assert e.value.kind is ErrorKind.UNAVAILABLE and fe.scheduler.cancelled == [req]


def test_each_adapter_maps_every_kind() -> None:
    assert {k: status(k) for k in ErrorKind} == {
        ErrorKind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
        ErrorKind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
        ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
        ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE}
    assert all(k.value == status(k).value for k in ErrorKind)  # the canonical codes, as traced
    assert {k: HTTP_STATUS[k] for k in ErrorKind} == {
        ErrorKind.INVALID_ARGUMENT: 400, ErrorKind.RESOURCE_EXHAUSTED: 429,
        ErrorKind.INTERNAL: 500, ErrorKind.UNAVAILABLE: 503}
    assert {ErrorKind.of(c) for c in ("invalid_argument", "resource_exhausted", "unavailable",
                                      "internal")} == set(ErrorKind)


def test_the_trace_goes_on_from_the_clients_context_and_records_the_kind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An HTTP call's ``traceparent`` header (``ClientRequest.traceparent``) parents the
    request's span; a failure is recorded with its canonical status."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for name in ("OTEL_SDK_DISABLED", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG"):
        monkeypatch.delenv(name, raising=False)
    memory = InMemorySpanExporter()
    assert tracing.setup("spin-test", exporter=memory)
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    try:
        fe = frontend()
        req = fe.submit(ClientRequest(prompt="hi", max_tokens=3, request_id="traced",
                                      traceparent=parent))
        req.out.put_nowait(RequestError("unavailable", "verifier unreachable"))

        async def drain() -> None:
            async for _ in fe.events(req):
                pass

        with pytest.raises(RequestFailed):
            asyncio.run(drain())
    finally:
        tracing.shutdown()
    span = next(s for s in memory.get_finished_spans() if s.name == "spin.generate")
    assert span.context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert span.parent.span_id == 0xB7AD6B7169203331
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    assert span.status.description == "UNAVAILABLE: verifier unreachable"


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            names |= {f"{'.' * node.level}{node.module or ''}"}
            names |= {f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names}
    return names


@pytest.mark.parametrize("path", ["router/frontend.py", "router/validation.py",
                                  "openai_api/app.py", "openai_api/completions.py",
                                  "openai_api/protocol.py", "openai_api/chat.py",
                                  "openai_api/server.py"])
def test_no_wire_protocol_in_the_frontend_or_on_the_http_path(path: str) -> None:
    wire = [n for n in _imports(SERVICES / path)
            if n.split(".")[0] in ("grpc", "google") or "v1" in n.split(".") or "rpc" in n]
    assert wire == []
