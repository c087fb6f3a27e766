"""The OpenAI-compatible HTTP API of the router (FastAPI), served on the gRPC server's event loop.

``POST /v1/completions``, ``POST /v1/chat/completions`` (whole, or streamed as server-sent
events: one event per verification step of each choice, then ``data: [DONE]``),
``GET /v1/models``, ``GET /health`` and ``/openapi.json``. Requests go through the router's
``Frontend``, as the gRPC API's do (``completions.py``). Errors are OpenAI's error objects: 400
bad input, 401 a missing or wrong API key (``Authorization: Bearer``), 404 an unknown model or
path, 429 a full queue, 503 no verifier. ``/health`` and ``/openapi.json`` need no key.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from ..router.frontend import ErrorKind, Frontend, RequestFailed
from . import protocol as p
from .chat import ChatTemplate
from .structured import CallStream, StructuredError, grammar_of, tool_calls
from .completions import (BadRequest, Choice, check_common, client_request, merged, new_id, now,
                          prompts_of, record, submit_all, usage)

log = logging.getLogger(__name__)
HTTP_STATUS = {ErrorKind.INVALID_ARGUMENT: 400, ErrorKind.RESOURCE_EXHAUSTED: 429,
               ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500}
"""The HTTP status of each ``Frontend`` error."""
ERROR_TYPE = {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
              429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
ERRORS = {code: {"model": p.ErrorResponse} for code in (400, 401, 404, 429, 500, 503)}
"""Documented on every operation (``/openapi.json``)."""
SSE = {200: {"content": {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string", "description": "a chunk (JSON), then [DONE]"},
                   "event": {"type": "string"}, "id": {"type": "string"}}}}}}}
"""A streamed response: server-sent events, each one chunk (``stream: true``)."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(status: int, message: str, param: str | None = None,
                   code: str | None = None) -> JSONResponse:
    body = p.ErrorResponse(error=p.ErrorBody(message=message, type=ERROR_TYPE.get(status, "error"),
                                             param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def create_app(frontend: Frontend, chat: ChatTemplate, model: str, api_key: str | None,
               ready: Callable[[], bool]) -> FastAPI:
    """The API over ``frontend``; ``model``: the served model's id; ``ready()``: whether a
    verifier can be reached now (``/health``)."""
    app = FastAPI(title="SPIN serving", version="1",
                  description="OpenAI-compatible API of the SPIN router (speculative decoding "
                              "with per-request drafter choice).")
    app.openapi = _openapi(app, model, frontend.max_context)
    _error_handlers(app)
    auth = [Depends(_authorizer(api_key))]

    @app.get("/health", response_model=p.Health, responses={503: {"model": p.Health}})
    async def health() -> JSONResponse:
        up = ready()
        return JSONResponse({"status": "ok" if up else "unavailable"},
                            status_code=200 if up else 503)

    @app.get("/v1/models", response_model=p.ModelList, responses=ERRORS, dependencies=auth)
    async def models() -> p.ModelList:
        return p.ModelList(data=[p.ModelCard(id=model, created=now(),
                                             max_model_len=frontend.max_context,
                                             drafters=sorted(frontend.drafter_names))])

    _completions_route(app, frontend, model, auth)
    _chat_route(app, frontend, chat, model, auth)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"],
                   include_in_schema=False)
    async def not_found(path: str) -> JSONResponse:
        return error_response(404, f"no such path: /{path}", code="not_found")

    return app


def _openapi(app: FastAPI, model: str, max_context: int) -> Callable[[], dict]:
    """``app.openapi``: the generated schema, told what this server serves: its model's id, the
    context's bound on ``max_tokens``, and an example of each request (what schema-driven
    clients and fuzzers send)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version,
                                 description=app.description, routes=app.routes)
            comps = schema["components"]["schemas"]
            examples = {"CompletionRequest": {"prompt": "def parse(path):"},
                        "ChatCompletionRequest": {"messages": [{"role": "user",
                                                                "content": "def parse(path):"}]}}
            for name, example in examples.items():
                props = comps[name]["properties"]
                props["model"]["enum"] = [model]
                for field in ("max_tokens", "max_completion_tokens"):
                    for branch in props.get(field, {}).get("anyOf", []):
                        if branch.get("type") == "integer":
                            branch["maximum"] = max_context
                comps[name]["examples"] = [{"model": model, "max_tokens": 16, "temperature": 0,
                                            **example}]
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _error_handlers(app: FastAPI) -> None:
    """Every error as an OpenAI error object."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        param = ".".join(str(x) for x in first.get("loc", ())[1:]) or None
        return error_response(400, f"{param or 'body'}: {first.get('msg', 'invalid request')}",
                              param)

    @app.exception_handler(HTTPException)
    async def _http(_: Request, e: HTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))


def _authorizer(api_key: str | None) -> Callable[[Request], None]:
    """A dependency that refuses (401) a request without ``Authorization: Bearer <api_key>``."""
    def authorize(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(),
                                                                  api_key.encode()):
            raise APIError(401, "a valid API key is required (Authorization: Bearer KEY)",
                           code="invalid_api_key")

    return authorize


def _check_model(name: str, model: str) -> None:
    if name != model:
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{model!r}", "model", "model_not_found")


def _completions_route(app: FastAPI, frontend: Frontend, model: str, auth: list) -> None:
    """``POST /v1/completions``."""
    tok = frontend.tokenizer

    @app.post("/v1/completions", response_model=p.CompletionResponse,
              responses={**ERRORS, **SSE}, dependencies=auth)
    async def completions(body: p.CompletionRequest, request: Request):
        _check_model(body.model, model)
        rid = new_id("cmpl")
        try:
            check_common(body)
            prompts = prompts_of(body)
            grammar = grammar_of(body)
        except (BadRequest, StructuredError) as e:
            raise APIError(400, str(e), e.param) from None
        reqs = [(i, client_request(f"{rid}-{i * body.n + c}", prompt, body.max_tokens or 16,
                                   body, c, body.logprobs, _trace(request), grammar))
                for i, prompt in enumerate(prompts) for c in range(body.n)]
        choices = _submit(frontend, reqs, body.user)
        if body.stream:
            return _stream(frontend, choices, body, rid, "text_completion",
                           lambda c, chunk: {"index": c.index, "text": chunk.text,
                                             **_ids(body, chunk.token_ids),
                                             "logprobs": _completion_logprobs(tok, chunk.logprobs,
                                                                              chunk.token_ids,
                                                                              body.logprobs),
                                             "finish_reason": chunk.finish})
        await _collect(frontend, choices)
        return p.CompletionResponse(
            id=rid, created=now(), model=model, usage=usage(choices),
            choices=[p.CompletionChoice(index=c.index, text="".join(c.text),
                                        **_ids(body, c.token_ids),
                                        logprobs=_completion_logprobs(tok, c.logprobs, c.token_ids,
                                                                      body.logprobs),
                                        finish_reason=c.finish) for c in choices])


def _chat_route(app: FastAPI, frontend: Frontend, chat: ChatTemplate, model: str,
                auth: list) -> None:
    """``POST /v1/chat/completions``."""
    tok = frontend.tokenizer

    @app.post("/v1/chat/completions", response_model=p.ChatCompletionResponse,
              responses={**ERRORS, **SSE}, dependencies=auth)
    async def chat_completions(body: p.ChatCompletionRequest, request: Request):
        _check_model(body.model, model)
        rid = new_id("chatcmpl")
        try:
            check_common(body)
            grammar = grammar_of(body)
            ids = frontend.tokenize(chat.render(body.messages, body.tools))
        except (BadRequest, StructuredError) as e:
            raise APIError(400, str(e), e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), "messages") from None
        room = frontend.max_context - len(ids)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(1, room)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        reqs = [(0, client_request(f"{rid}-{c}", ids, max_tokens, body, c, logprobs,
                                   _trace(request), grammar)) for c in range(body.n)]
        choices = _submit(frontend, reqs, body.user)
        if body.stream:
            started: set[int] = set()
            calls = CallStream(body)

            def delta(c: Choice, chunk) -> dict:
                d, finish = calls.delta(c.index, chunk)
                if c.index not in started:
                    started.add(c.index)
                    d["role"] = "assistant"
                return {"index": c.index, "delta": d, "finish_reason": finish,
                        **_ids(body, chunk.token_ids),
                        "logprobs": _chat_logprobs(tok, chunk.logprobs, chunk.token_ids)}

            return _stream(frontend, choices, body, rid, "chat.completion.chunk", delta)
        await _collect(frontend, choices)
        replies = [("".join(c.text), tool_calls(body, "".join(c.text))) for c in choices]
        return p.ChatCompletionResponse(
            id=rid, created=now(), model=model, usage=usage(choices),
            choices=[p.ChatChoice(index=c.index, **_ids(body, c.token_ids),
                                  message=p.ChatMessage(content=None if calls else text,
                                                        tool_calls=calls),
                                  logprobs=_chat_logprobs(tok, c.logprobs, c.token_ids)
                                  if logprobs is not None else None,
                                  finish_reason="tool_calls" if calls else c.finish)
                     for c, (text, calls) in zip(choices, replies)])


def _submit(frontend: Frontend, reqs: list, user: str | None) -> list[Choice]:
    try:
        choices = submit_all(frontend, reqs)
    except RequestFailed as e:
        raise APIError(HTTP_STATUS[e.kind], e.message) from None
    if user:
        log.info("requests %s for user %r", [c.req.request_id for c in choices], user)
    return choices


async def _collect(frontend: Frontend, choices: list[Choice]) -> None:
    try:
        async for c, chunk in merged(frontend, choices):
            record(c, chunk)
    except RequestFailed as e:
        raise APIError(HTTP_STATUS[e.kind], e.message) from None


def _trace(request: Request) -> tuple[str, str]:
    """The call's W3C trace context headers (``traceparent``, ``tracestate``; '' when absent)."""
    return request.headers.get("traceparent", ""), request.headers.get("tracestate", "")


def _stream(frontend: Frontend, choices: list[Choice], body, rid: str,
            obj: str, choice_json: Callable[[Choice, object], dict]) -> StreamingResponse:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created, model = now(), body.model

    async def events() -> AsyncIterator[str]:
        try:
            async for c, chunk in merged(frontend, choices):
                record(c, chunk)
                msg = {"id": rid, "object": obj, "created": created, "model": model,
                       "choices": [choice_json(c, chunk)]}
                yield f"data: {json.dumps(msg)}\n\n"
        except RequestFailed as e:
            status = HTTP_STATUS[e.kind]
            err = p.ErrorBody(message=e.message, type=ERROR_TYPE.get(status, "error"))
            yield f"data: {json.dumps({'error': err.model_dump()})}\n\n"
            return
        if include_usage:
            msg = {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                   "usage": usage(choices).model_dump()}
            yield f"data: {json.dumps(msg)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _ids(body, token_ids: list[int]) -> dict:
    """``token_ids`` for a choice when the request asked (``return_token_ids``)."""
    return {"token_ids": list(token_ids)} if body.return_token_ids else {}


def _token_text(tok, token_id: int) -> str:
    return tok.decode([token_id])


def _completion_logprobs(tok, logprobs: list | None, token_ids: list[int],
                         top: int | None) -> dict | None:
    """The completions API's ``logprobs`` object for these tokens (None when not asked)."""
    if top is None or logprobs is None:
        return None
    texts = [_token_text(tok, t) for t in token_ids]
    offsets, at = [], 0
    for t in texts:
        offsets.append(at)
        at += len(t)
    return {"tokens": texts, "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{_token_text(tok, i): v for i, v in lp.top} for lp in logprobs]
            if top else None, "text_offset": offsets}


def _chat_logprobs(tok, logprobs: list | None, token_ids: list[int]) -> dict | None:
    """The chat API's ``logprobs`` object for these tokens (None when not asked)."""
    if logprobs is None:
        return None

    def entry(token_id: int, value: float) -> dict:
        text = _token_text(tok, token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {"content": [entry(t, lp.logprob) | {"top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for t, lp in zip(token_ids, logprobs)]}
