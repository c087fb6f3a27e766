"""OpenTelemetry tracing of the SPIN services, configured by the standard ``OTEL_*`` variables.

On iff ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is set and
``OTEL_SDK_DISABLED`` is not ``true``. Spans go over OTLP/gRPC through a ``BatchSpanProcessor``
(``OTEL_BSP_*`` tune it), flushed by ``shutdown()`` when the process drains on SIGTERM. The sampler
is the SDK's from ``OTEL_TRACES_SAMPLER``/``OTEL_TRACES_SAMPLER_ARG``; unset, the SDK default
``parentbased_always_on`` applies (every request traced; deployments set
``parentbased_traceidratio`` and a ratio). ``service.name`` comes from ``OTEL_SERVICE_NAME`` (or
``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``), else the role: ``spin-router``,
``spin-verifier``, ``spin-drafter-<name>``. A plaintext collector needs an ``http://`` endpoint
(or ``OTEL_EXPORTER_OTLP_INSECURE=true``), as with every OTLP/gRPC exporter.

Off, nothing but the OpenTelemetry API is imported and no span object is ever created: the router
gives untraced requests no ``RequestTrace``, tasks carry an empty ``traceparent``, and services
skip their batch spans.

One request's trace, across processes::

    /spin.v1.Generation/Generate      router, SERVER (gRPC instrumentation; continues a
    └─ spin.generate                   router        client's traceparent from metadata)
       └─ spin.step (one per step)     router: drafter, k, drafted, accepted
          ├─ spin.draft                drafter: request id, k, tree size
          └─ spin.verify               verifier: request id, tree size, accepted

The router <-> drafter/verifier streams are long-lived and carry batches of many requests, so the
context travels per task (``DraftTask.traceparent``/``VerifyTask.traceparent``: the step span's W3C
``traceparent``), not per RPC. A service records each traced task as a child span of that context,
which makes router -> drafter -> verifier one parent/child chain in the request's trace, and one
``spin.drafter.speculate``/``spin.verifier.verify`` span per batch that holds traced tasks; the
batch span is the root of its own trace (sampled like any root) and linked both ways with its
tasks' spans, so a request's step leads to the batch it shared and a batch lists its requests.
The bidi streams themselves are not instrumented (one span per stream would last as long as the
connection and parent every batch of every request); health and reflection neither (probe noise).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
"""Either one set turns tracing on."""
_PROPAGATOR = TraceContextTextMapPropagator()

_provider: Any = None  # opentelemetry.sdk.trace.TracerProvider while tracing is on
_tracer: trace.Tracer = trace.NoOpTracer()
_redis: Any = None  # the RedisInstrumentor this module turned on


def configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment asks for tracing (an OTLP endpoint, SDK not disabled)."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(name, "").strip() for name in ENDPOINT_VARS)


def enabled() -> bool:
    """Whether this process exports spans (``setup`` turned tracing on)."""
    return _provider is not None


def tracer() -> trace.Tracer:
    """The SPIN tracer: a no-op tracer while tracing is off."""
    return _tracer


def setup(default_service: str, *, redis: bool = False, exporter: Any = None) -> bool:
    """Turn tracing on for this process if the environment asks for it; True if on.

    ``default_service`` is the ``service.name`` unless the environment names one; ``redis`` also
    traces every Redis command (the router's statistics store); ``exporter`` replaces the OTLP
    exporter (tests). Calling it again while on changes nothing. The provider is handed to the
    instrumentations explicitly; the process-wide default provider is left alone.
    """
    global _provider, _tracer, _redis
    if _provider is not None:
        return True
    if not configured():
        return False
    from opentelemetry.sdk.resources import (
        SERVICE_NAME,
        SERVICE_VERSION,
        OTELResourceDetector,
        Resource,
    )
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from .. import __version__

    attributes: dict[str, str] = {SERVICE_VERSION: __version__}
    if not os.environ.get("OTEL_SERVICE_NAME") and \
            not OTELResourceDetector().detect().attributes.get(SERVICE_NAME):
        attributes[SERVICE_NAME] = default_service
    provider = TracerProvider(resource=Resource.create(attributes))  # sampler: OTEL_TRACES_SAMPLER
    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    if redis:
        from opentelemetry.instrumentation.redis import RedisInstrumentor
        _redis = RedisInstrumentor()
        _redis.instrument(tracer_provider=provider)
    _provider = provider
    _tracer = provider.get_tracer("spin", __version__)
    log.info("tracing on: service %s, sampler %s", provider.resource.attributes.get(SERVICE_NAME),
             provider.sampler.get_description())
    return True


def shutdown() -> None:
    """Export what is buffered and turn tracing off (the end of a graceful stop)."""
    global _provider, _tracer, _redis
    if _provider is None:
        return
    provider, _provider, _tracer = _provider, None, trace.NoOpTracer()
    if _redis is not None:
        _redis.uninstrument()
        _redis = None
    provider.shutdown()  # flushes the BatchSpanProcessor (bounded by the exporter's timeout)


def server_interceptors(service_names: Iterable[str]) -> list:
    """The gRPC instrumentation for a ``grpc.aio`` server: a SERVER span per unary or
    server-streaming call of these services (``Generate``, ``Get*Info``); bidi streams, health
    and reflection are left out. Empty while tracing is off."""
    if _provider is None:
        return []
    from google.protobuf import descriptor_pool
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    pool = descriptor_pool.Default()
    traced = {f"/{name}/{m.name}" for name in service_names
              for m in pool.FindServiceByName(name).methods if not m.client_streaming}
    return [_CloseStreams(),  # outermost: it wraps what the instrumentation returns
            aio_server_interceptor(tracer_provider=_provider,
                                   filter_=lambda details: details.method in traced)]


class _CloseStreams(grpc.aio.ServerInterceptor):
    """Serves a server-streaming handler's async generator through ``context.write`` and closes
    it in the call's own task when the call ends, however it ends.

    grpc.aio drains a handler's generator itself, and when the client cancels while a response
    is being written it drops the generator suspended at its ``yield``. The event loop's
    finalizer later closes it in another task, where the gRPC instrumentation's span and
    context (attached in the call's task) cannot be detached: "Failed to detach context" with a
    traceback, once per cancelled call. Here the generator is closed before the call's task
    ends, so the server span ends and its context is detached where it was attached.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or not handler.response_streaming \
                or not inspect.isasyncgenfunction(handler.unary_stream):
            return handler
        behavior = handler.unary_stream

        async def write_all(request: Any, context: grpc.aio.ServicerContext) -> None:
            responses = behavior(request, context)
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                await responses.aclose()

        return grpc.unary_stream_rpc_method_handler(
            write_all, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)


# ---- W3C trace context in a string --------------------------------------------------------------
def inject(span: trace.Span) -> tuple[str, str]:
    """``(traceparent, tracestate)`` header values naming ``span`` as the parent; empty strings
    for a span that is not sampled (nobody downstream should record anything under it)."""
    ctx = span.get_span_context()
    if not ctx.is_valid or not ctx.trace_flags.sampled:
        return "", ""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", ""), carrier.get("tracestate", "")


def extract(traceparent: str, tracestate: str = "") -> Context | None:
    """The context a ``traceparent`` (and ``tracestate``) header value names; None when empty or
    malformed."""
    if not traceparent:
        return None
    carrier = {"traceparent": traceparent}
    if tracestate:
        carrier["tracestate"] = tracestate
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


# ---- the router: one request ---------------------------------------------------------------------
class StatusLike(Protocol):
    """A status code as gRPC's ``StatusCode`` gives it: a name, and (number, text) as value."""

    name: str
    value: tuple[int, str]


class RequestTrace:
    """The router's spans of one sampled request: ``spin.generate`` and a ``spin.step`` per step,
    whose context the step's draft and verify tasks carry."""

    __slots__ = ("span", "step", "steps", "traceparent", "tracestate", "_context", "_outcome")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.step: trace.Span | None = None
        self.steps = 0
        self.traceparent = ""
        """The open step's ``traceparent`` (empty between steps)."""
        self.tracestate = ""
        self._context = trace.set_span_in_context(span)
        self._outcome = False  # a final response or an error was seen

    @classmethod
    def start(cls, req: Any) -> RequestTrace | None:
        """Start ``spin.generate`` for a router request, under the current context (the gRPC
        server span); None when tracing is off or the request is not sampled."""
        if _provider is None:
            return None
        span = _tracer.start_span("spin.generate", attributes={
            "spin.request_id": req.request_id, "spin.prompt_tokens": len(req.prompt),
            "spin.max_tokens": req.params.max_tokens, "spin.mode": req.params.mode,
            "spin.requested_drafter": req.params.drafter or "", "spin.requested_k": req.params.k})
        if not span.is_recording():
            return None
        return cls(span)

    def start_step(self, drafter: str | None, k: int) -> None:
        """Open the next ``spin.step`` (closing one that got no verdict)."""
        if self.step is not None:
            self.step.set_attribute("spin.verified", False)
            self.step.end()
        self.steps += 1
        self.step = _tracer.start_span("spin.step", context=self._context, attributes={
            "spin.step": self.steps, "spin.drafter": drafter or "", "spin.k": k if drafter else 0})
        self.traceparent, self.tracestate = inject(self.step)

    def end_step(self, drafter: str | None, drafted: int, accepted: int, resync: bool) -> None:
        """Close the open step with its outcome (``drafter`` None: it ran without a draft)."""
        step, self.step = self.step, None
        self.traceparent = self.tracestate = ""
        if step is None:
            return
        step.set_attributes({"spin.verified": not resync, "spin.resync": resync,
                             "spin.effective_drafter": drafter or "", "spin.draft_tokens": drafted,
                             "spin.accepted": accepted})
        step.end()

    def observe(self, event: Any) -> None:
        """A message for the client (the router's ``streaming.Chunk``): the last one's outcome."""
        if getattr(event, "finish", None) is None:
            return
        self._outcome = True
        s = event.speculation
        self.span.set_attributes({
            "spin.completion_tokens": event.usage.completion_tokens,
            "spin.finish_reason": event.finish, "spin.steps": s.steps,
            "spin.steps_without_speculation": s.steps_without_speculation,
            "spin.draft_tokens": s.draft_tokens, "spin.accepted_tokens": s.accepted_tokens,
            "spin.tau": s.tau})

    def fail(self, code: StatusLike, message: str) -> None:
        """The stream ends with an error: ``code`` is its status (``grpc.StatusCode``, or the
        router frontend's ``ErrorKind``, which carries the same code)."""
        self._outcome = True
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}"))

    def end(self) -> None:
        """The client stream is over (finished, failed or cancelled)."""
        if self.step is not None:
            self.end_step(None, 0, 0, True)
        if not self._outcome:
            self.span.set_attribute("spin.cancelled", True)  # client cancel or deadline
        self.span.end()


def start_steps(reqs: Iterable[Any], choices: Iterable[Any]) -> None:
    """Open a ``spin.step`` for every traced request of a micro-batch (its policy choice)."""
    if _provider is None:
        return
    for r, c in zip(reqs, choices):
        if r.trace is not None:
            r.trace.start_step(c.drafter, c.k)


def end_step(req: Any, choice: Any, drafted: int, result: Any) -> None:
    """Close a traced request's step with the verifier's result (the router's plain
    ``VerifyResult``: ``num_accepted``, ``resync``)."""
    if req.trace is not None:
        req.trace.end_step(choice.drafter, drafted, result.num_accepted, result.resync)


# ---- drafter and verifier: one batch -----------------------------------------------------------
def record_batch(name: str, task_name: str, start_ns: int, end_ns: int,
                 attributes: Mapping[str, Any],
                 tasks: Iterable[tuple[str, str, Mapping[str, Any]]],
                 error: BaseException | None = None) -> None:
    """Spans of one service batch, recorded once it ran (``start_ns``..``end_ns``, epoch ns).

    ``tasks``: ``(traceparent, tracestate, attributes)`` of each task carrying a trace context.
    Each gets a ``task_name`` SERVER span, child of the router's step span; the batch gets a
    ``name`` span linked to them (and they to it). Nothing at all without such a task.
    """
    if _provider is None:
        return
    traced = [(ctx, attrs) for tp, ts, attrs in tasks if (ctx := extract(tp, ts)) is not None]
    if not traced:
        return
    batch = _tracer.start_span(
        name, context=Context(), kind=SpanKind.INTERNAL, start_time=start_ns,
        attributes={**attributes, "spin.traced_tasks": len(traced)},
        links=[Link(trace.get_current_span(ctx).get_span_context()) for ctx, _ in traced])
    links = [Link(batch.get_span_context())] if batch.get_span_context().trace_flags.sampled else []
    status = Status(StatusCode.ERROR, str(error)) if error is not None else None
    for ctx, attrs in traced:
        span = _tracer.start_span(task_name, context=ctx, kind=SpanKind.SERVER,
                                  start_time=start_ns, attributes={**attributes, **attrs},
                                  links=links)
        if status is not None:
            span.set_status(status)
        span.end(end_time=end_ns)
    if status is not None:
        batch.set_status(status)
    batch.end(end_time=end_ns)
