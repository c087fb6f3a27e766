"""What the router's client APIs share: a request in (validated, admitted), its stream events out.

The gRPC adapter (``server.py``) and the OpenAI-compatible HTTP adapter (``openai_api/``) each
turn their message into a plain ``validation.ClientRequest`` and go through ``Frontend``: the
same validation, the same admission into the scheduler's queue, the same events
(``streaming.Chunk``), so their outputs are the same token for token. ``Frontend`` speaks no
wire protocol: a refused or failed request raises ``RequestFailed`` with an ``ErrorKind``, which
each adapter maps to its own status (a gRPC status code, an HTTP status and OpenAI error object).
A request's id stays taken until the scheduler has finished it (a cancelled request only some
time after its stream ended): the scheduler and the services key their state by it.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator

from opentelemetry import context as otel_context

from ..engine.grammar import GrammarCompiler
from ..obs import metrics, tracing
from .requests import RouterRequest
from .scheduler import QueueFull, Scheduler
from .streaming import Chunk, RequestError
from .validation import ClientRequest, validate

MAX_TRACKED_IDS = 4096
"""Ids of requests remembered before the finished ones among them are forgotten."""


class ErrorKind(enum.Enum):
    """Why a request was refused or failed. The values are the canonical status codes (number,
    description), which gRPC uses and traces record; each adapter maps a kind by its name."""

    INVALID_ARGUMENT = (3, "invalid argument")
    """Bad input: the message names the field and its allowed range."""
    RESOURCE_EXHAUSTED = (8, "resource exhausted")
    """The queue is full: try again later."""
    INTERNAL = (13, "internal")
    """The router failed the request (a bug)."""
    UNAVAILABLE = (14, "unavailable")
    """No verifier could serve it (e.g. one down longer than the router waits)."""

    @classmethod
    def of(cls, code: str) -> ErrorKind:
        """The kind of a scheduler's ``RequestError`` code ('invalid_argument', ...)."""
        return cls[code.upper()]


class RequestFailed(Exception):
    """A request refused (bad input, a full queue) or failed while it ran."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class Frontend:
    """Requests into the scheduler and their events back (module docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer, max_context: int, vocab_size: int) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        """The target's tokenizer (the HTTP API renders chat messages and logprobs with it)."""
        self.max_context = max_context
        """Longest request, prompt and output together (the verifier's context)."""
        self.vocab_size = vocab_size
        """Token ids a prompt may hold are below it."""
        self.requests: dict[str, RouterRequest] = {}
        """Request id -> the request last submitted with it."""
        self._grammars: GrammarCompiler | None = None

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output grammars, compiled for the target's tokenizer (built at the
        first request with a grammar)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    @property
    def drafter_names(self) -> set[str]:
        """Drafters a request may name now (discovery adds them as they appear)."""
        return set(self.scheduler.proposers)

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids, as a prompt is tokenized (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def submit(self, request: ClientRequest) -> RouterRequest:
        """Validate and admit ``request``; RequestFailed (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)
        when it is refused. Its events then come from ``events``."""
        try:
            req = validate(request, self.tokenize, self.max_context, self.vocab_size,
                           lambda: self.drafter_names)
            self._check_id_free(req.request_id)
            if req.params.grammar is not None:  # GrammarError (a ValueError) says why not
                req.constraint = self.grammars.constraint(req.params.grammar)
        except ValueError as e:
            raise self.refuse(ErrorKind.INVALID_ARGUMENT, str(e)) from None
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            raise self.refuse(ErrorKind.RESOURCE_EXHAUSTED, str(e)) from None
        self.requests[req.request_id] = req
        req.trace = _start_trace(req, request)  # None unless traced (and sampled)
        return req

    @staticmethod
    def refuse(kind: ErrorKind, message: str) -> RequestFailed:
        """The error refusing a request, counted (``spin:request_errors`` by the kind's name);
        for an adapter too, when its message cannot even become a ``ClientRequest``."""
        metrics.REQUEST_ERRORS.labels(kind.name).inc()
        return RequestFailed(kind, message)

    def cancel(self, req: RouterRequest) -> None:
        """Stop ``req`` (its client went away) and free its caches; nothing once it finished."""
        self.scheduler.cancel(req)

    async def events(self, req: RouterRequest) -> AsyncIterator[Chunk]:
        """``req``'s chunks up to the last (``finish`` set); RequestFailed if it fails. Leaving
        early (the client went away) cancels it and frees its caches in every service."""
        try:
            while True:
                event = await req.out.get()
                if isinstance(event, RequestError):
                    kind = ErrorKind.of(event.code)
                    if req.trace is not None:
                        req.trace.fail(kind, event.message)
                    raise RequestFailed(kind, event.message)
                if req.trace is not None:
                    req.trace.observe(event)
                yield event
                if event.finish is not None:
                    return
        finally:
            self.scheduler.cancel(req)  # no-op when finished; frees the caches otherwise
            if req.finished and self.requests.get(req.request_id) is req:
                del self.requests[req.request_id]
            if req.trace is not None:
                req.trace.end()

    def _check_id_free(self, request_id: str) -> None:
        """ValueError when a request the scheduler has not finished has ``request_id``."""
        old = self.requests.get(request_id)
        if old is not None and not old.finished:
            raise ValueError(f"request_id {request_id!r} is in use by a running request")
        if len(self.requests) >= MAX_TRACKED_IDS:  # cancelled ones finish after their streams
            self.requests = {i: r for i, r in self.requests.items() if not r.finished}


def _start_trace(req: RouterRequest, asked: ClientRequest) -> tracing.RequestTrace | None:
    """The request's trace, under the client's trace context when its API carried one (else
    under the current context: the gRPC server span)."""
    parent = tracing.extract(asked.traceparent, asked.tracestate) if tracing.enabled() else None
    if parent is None:
        return tracing.RequestTrace.start(req)
    token = otel_context.attach(parent)
    try:
        return tracing.RequestTrace.start(req)
    finally:
        otel_context.detach(token)
