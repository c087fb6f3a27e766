"""What the router's client APIs share: a request in (validated, admitted), its stream events out.

The gRPC service (``server.py``) and the OpenAI-compatible HTTP API (``openai_api/``) both build
a ``spin.v1.GenerateRequest`` and go through ``Frontend``: the same validation
(``validation.py``), the same admission into the scheduler's queue, the same events
(``streaming.Chunk``), so their outputs are the same token for token. A request's id stays taken
until the scheduler has finished it (a cancelled request only some time after its stream ended):
the scheduler and the services key their state by it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from ..obs import metrics, tracing
from ..policy.base import PROMPT_LOOKUP
from ..v1 import generation_pb2
from .requests import RouterRequest
from .scheduler import QueueFull, Scheduler
from .streaming import Chunk, ErrorCode, RequestError
from .validation import MAX_K, request_from_proto

STATUS: dict[ErrorCode, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "resource_exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "internal": grpc.StatusCode.INTERNAL,
}
"""The gRPC status of each ``RequestError`` code (the HTTP API maps them to its own)."""
MAX_TRACKED_IDS = 4096
"""Ids of requests remembered before the finished ones among them are forgotten."""


class RequestFailed(Exception):
    """A request refused (bad input, a full queue) or failed while it ran."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Frontend:
    """Requests into the scheduler and their events back (module docstring)."""

    def __init__(self, scheduler: Scheduler, tokenizer, max_context: int, vocab_size: int,
                 max_k: int = MAX_K) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.max_k = max_k
        """Largest ``speculation.k`` a request may ask for."""
        self.requests: dict[str, RouterRequest] = {}
        """Request id -> the request last submitted with it."""

    @property
    def drafter_names(self) -> set[str]:
        """Drafters a request may name now (discovery adds them as they appear)."""
        names = set(self.scheduler.drafters)
        return names | {PROMPT_LOOKUP} if self.scheduler.cfg.prompt_lookup else names

    def parse(self, req: generation_pb2.GenerateRequest) -> RouterRequest:
        """The request as the scheduler takes it; ValueError (and nothing else) names what is
        wrong and the allowed range (``validation.py``)."""
        return request_from_proto(req, self.tokenize, self.max_context, self.vocab_size,
                                  lambda: self.drafter_names, self.max_k)

    def tokenize(self, text: str) -> list[int]:
        """``text``'s token ids, as a prompt is tokenized (no special tokens added)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def submit(self, request: generation_pb2.GenerateRequest) -> RouterRequest:
        """Validate and admit ``request``; RequestFailed (invalid_argument, resource_exhausted)
        when it is refused. Its events then come from ``events``."""
        try:
            req = self.parse(request)
            self._check_id_free(req.request_id)
        except ValueError as e:
            metrics.REQUEST_ERRORS.labels(grpc.StatusCode.INVALID_ARGUMENT.name).inc()
            raise RequestFailed("invalid_argument", str(e)) from None
        try:
            self.scheduler.submit(req)
        except QueueFull as e:
            metrics.REQUEST_ERRORS.labels(grpc.StatusCode.RESOURCE_EXHAUSTED.name).inc()
            raise RequestFailed("resource_exhausted", str(e)) from None
        self.requests[req.request_id] = req
        req.trace = tracing.RequestTrace.start(req)  # None unless traced (and sampled)
        return req

    async def events(self, req: RouterRequest) -> AsyncIterator[Chunk]:
        """``req``'s chunks up to the last (``finish`` set); RequestFailed if it fails. Leaving
        early (the client went away) cancels it and frees its caches in every service."""
        try:
            while True:
                event = await req.out.get()
                if isinstance(event, RequestError):
                    if req.trace is not None:
                        req.trace.fail(STATUS[event.code], event.message)
                    raise RequestFailed(event.code, event.message)
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
