"""The OpenAI-compatible backend: every request one streamed ``POST {base}/v1/completions``.

Works with any server of OpenAI's completions API (ours, vLLM, SGLang). Each request asks for
``stream: true``, ``stream_options.include_usage`` (the last event carries the usage, and with
ours ``usage.speculation``), ``return_token_ids`` and ``ignore_eos`` (vLLM's extensions; SGLang and
ours take them too) and sends ``temperature``, ``top_p`` and, when temperature > 0,
``seed + index``. The ``speculation`` extension (ours) goes out only when the run asks for
something other than the server's default (``--speculation`` or ``--k`` given); a server that
refuses unknown fields refuses it.

Timing follows the gRPC client: an event carrying at least one token (token ids, or text when
the server returns no ids) is one message; TTFT is send -> the first, ITL the gap between two,
E2E send -> the event with the finish reason. Servers that return no token ids get their output
text tokenized after the run (``--tokenizer``): the counts, not the timing, use it. An HTTP
error (a status other than 200, or an error event mid-stream) fails only its request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .client import ClientConfig, EndpointUnreachable
from .report import DrafterCounts, RequestResult, SpecCounts
from .workload import Request

MAX_MESSAGE = 500
"""Characters of an error body kept when it is not OpenAI's error object."""
_LINE_END = re.compile(rb"\r\n|\r|\n")


class ServerRefused(Exception):
    """The server answered, but not so that a run can start (a bad key, no model listed)."""


@dataclass(frozen=True)
class HttpConfig:
    """What the OpenAI-compatible backend needs beyond ``ClientConfig``."""

    model: str | None = None
    """The ``model`` of every request; None: the first id ``GET /v1/models`` lists."""
    send_speculation: bool = False
    """Send the ``speculation`` extension even for ``auto`` (the server's default, otherwise left
    out so that servers without the extension accept the requests)."""
    tokenizer: str | None = None
    """Local tokenizer directory that counts the tokens of a server that returns no token ids
    (None: such requests count no tokens)."""


def base_url(endpoint: str, tls_ca: str | None = None) -> str:
    """``host:port`` (https with ``tls_ca``) or a URL, with or without ``/v1`` -> the server's
    root URL, no trailing slash; ValueError for what is neither."""
    text = endpoint.strip()
    if "://" not in text:
        text = ("https://" if tls_ca is not None else "http://") + text
    u = urllib.parse.urlsplit(text)
    try:
        u.port  # noqa: B018 -- raises for a port that is no number
    except ValueError:
        raise ValueError(f"bad endpoint {endpoint!r}: the port is not a number") from None
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
        raise ValueError(f"bad endpoint {endpoint!r}: expected host:port or "
                         f"http(s)://host:port[/v1]")
    path = u.path.rstrip("/")
    path = path.removesuffix("/v1")
    return f"{u.scheme}://{u.netloc}{path}"


def speculation_body(spec: str, k: int = 0, early_stop: bool = False) -> dict[str, Any]:
    """``auto`` / ``off`` / drafter name (with its k) -> the ``speculation`` extension."""
    if spec in ("auto", "off"):
        return {"mode": spec}
    body: dict[str, Any] = {"mode": "drafter", "drafter": spec, "k": k}
    if early_stop:
        body["early_stop"] = True
    return body


def completion_body(cfg: ClientConfig, http: HttpConfig, model: str,
                    req: Request) -> dict[str, Any]:
    """The JSON body of one workload request."""
    body: dict[str, Any] = {
        "model": model, "prompt": req.prompt, "max_tokens": cfg.max_tokens, "stream": True,
        "stream_options": {"include_usage": True}, "temperature": cfg.temperature,
        "top_p": cfg.top_p, "ignore_eos": cfg.ignore_eos, "return_token_ids": True}
    if cfg.temperature > 0:
        body["seed"] = cfg.seed + req.index
    if http.send_speculation or cfg.speculation != "auto":
        body["speculation"] = speculation_body(cfg.speculation, cfg.k, cfg.early_stop)
    return body


def error_message(body: str) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message"}}``, ``{"message"}`` or
    FastAPI's ``{"detail"}``; else the body's start."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip()[:MAX_MESSAGE]
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if isinstance(obj.get(key), str):
                return obj[key]
    return body.strip()[:MAX_MESSAGE]


class SseParser:
    """Server-sent events from bytes as they arrive: the ``data`` of each complete event."""

    def __init__(self) -> None:
        self._buf = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The events that ``chunk`` completes (a ``data`` of several lines joined by newlines)."""
        self._buf += chunk
        out: list[str] = []
        while m := _LINE_END.search(self._buf):
            if m.group() == b"\r" and m.end() == len(self._buf):
                break  # a \n may follow in the next chunk
            line = self._buf[:m.start()].decode("utf-8", errors="replace")
            self._buf = self._buf[m.end():]
            if not line:
                if self._data:
                    out.append("\n".join(self._data))
                    self._data = []
            elif not line.startswith(":"):  # a comment (keep-alive)
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value.removeprefix(" "))
        return out

    def flush(self) -> list[str]:
        """At the end of the stream: an event that no blank line closed."""
        if self._buf:
            self.feed(b"\n")
        out = ["\n".join(self._data)] if self._data else []
        self._data = []
        return out


def spec_counts(u: dict[str, Any]) -> SpecCounts:
    """``usage.speculation`` (ours) -> ``SpecCounts``."""
    return SpecCounts(
        steps=int(u.get("steps") or 0),
        steps_without_speculation=int(u.get("steps_without_speculation") or 0),
        draft_tokens=int(u.get("draft_tokens") or 0),
        accepted_tokens=int(u.get("accepted_tokens") or 0),
        drafters={str(d.get("drafter")): DrafterCounts(int(d.get("steps") or 0),
                                                       int(d.get("draft_tokens") or 0),
                                                       int(d.get("accepted_tokens") or 0))
                  for d in u.get("drafters") or [] if isinstance(d, dict)})


class StreamTimer:
    """Times one completion's events into a ``RequestResult``, as the gRPC client times messages."""

    def __init__(self, res: RequestResult, start: float) -> None:
        self.res, self.start = res, start
        self.text: list[str] = []
        self.finished = False
        self.over = False
        """``[DONE]`` or an error came: later events are ignored."""
        self._last_token_at: float | None = None

    def _fail(self, code: str, message: str) -> bool:
        self.res.error_code, self.res.error_message = code, message
        self.over = True
        return False

    def event(self, data: str, now: float) -> bool:
        """Take one event's ``data`` received at ``now``; False once the stream is over."""
        if self.over or data.strip() == "[DONE]":
            self.over = True
            return False
        try:
            obj = json.loads(data)
        except ValueError:
            return self._fail("BAD_EVENT", f"an event is not JSON: {data[:MAX_MESSAGE]!r}")
        if not isinstance(obj, dict):
            return self._fail("BAD_EVENT", f"an event is not an object: {data[:MAX_MESSAGE]!r}")
        if obj.get("error"):
            return self._fail("STREAM_ERROR", error_message(data))
        res = self.res
        for choice in obj.get("choices") or []:
            ids, text = choice.get("token_ids"), choice.get("text") or ""
            if bool(ids) if ids is not None else bool(text):
                if self._last_token_at is None:
                    res.ttft_s = now - self.start
                else:
                    res.itls_s.append(now - self._last_token_at)
                self._last_token_at = now
            res.token_ids.extend(ids or [])
            self.text.append(text)
            if choice.get("finish_reason") is not None:
                self.finished = True
                res.e2e_s = now - self.start
        usage = obj.get("usage")
        if isinstance(usage, dict):
            res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            if isinstance(usage.get("speculation"), dict):
                res.speculation = spec_counts(usage["speculation"])
        return True

    def close(self) -> RequestResult:
        """The result once the stream ended (ok with a finish reason and no error)."""
        self.res.text = "".join(self.text)
        if self.res.error_code is None:
            if self.finished:
                self.res.ok = True
            else:
                self._fail("INCOMPLETE_STREAM", "the stream ended without a finish reason")
        return self.res


class TokenCounter:
    """Text -> token ids with a local tokenizer, loaded on first use."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok: Any = None

    def __call__(self, text: str) -> list[int]:
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        return list(self._tok.encode(text, add_special_tokens=False))


def count_tokens(results: Sequence[RequestResult], requests: Sequence[Request],
                 tokenize: Callable[[str], list[int]]) -> int:
    """Token ids for completed results whose server returned text but no ids, and prompt token
    counts where no usage came; returns how many outputs were tokenized."""
    prompts = {r.index: r.prompt for r in requests}
    counted = 0
    for r in results:
        if not r.ok:
            continue
        if not r.token_ids and r.text:
            r.token_ids = tokenize(r.text)
            counted += 1
        if r.prompt_tokens == 0 and r.index in prompts:
            r.prompt_tokens = len(tokenize(prompts[r.index]))
    return counted


class OpenAIBackend:
    """Requests as streamed completions of one HTTP session (``schedule.Backend``)."""

    def __init__(self, session: Any, base: str, model: str, http: HttpConfig,
                 api_key: str | None) -> None:
        self.session, self.base, self.model, self.http = session, base, model, http
        self.url = f"{base}/v1/completions"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.counter = TokenCounter(http.tokenizer) if http.tokenizer else None
        self.counted_tokens = False
        """Whether some output was counted with the tokenizer (the server returned no ids)."""

    async def send(self, req: Request, cfg: ClientConfig, suffix: str) -> RequestResult:
        import aiohttp

        res = RequestResult(index=req.index)
        body = completion_body(cfg, self.http, self.model, req)
        headers = {**self.headers, "X-Request-Id": f"loadgen-{cfg.seed}-{req.index}{suffix}"}
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        start = time.perf_counter()
        timer = StreamTimer(res, start)
        try:
            async with self.session.post(self.url, json=body, headers=headers,
                                         timeout=timeout) as resp:
                if resp.status != 200:
                    res.error_code = f"HTTP_{resp.status}"
                    res.error_message = error_message(await resp.text(errors="replace"))
                    return res
                parser, going = SseParser(), True
                async for chunk in resp.content.iter_any():
                    now = time.perf_counter()
                    for data in parser.feed(chunk):
                        going = going and timer.event(data, now)
                    if not going:
                        break
                else:
                    for data in parser.flush():
                        going = going and timer.event(data, time.perf_counter())
        except TimeoutError:
            res.error_code = "TIMEOUT"
            res.error_message = f"no complete response within {cfg.timeout_s} s"
            return res
        except aiohttp.ClientError as e:
            res.error_code, res.error_message = "CONNECTION_ERROR", str(e) or type(e).__name__
            return res
        return timer.close()

    def finish(self, results: list[RequestResult], requests: Sequence[Request]) -> None:
        """Count the tokens of servers that return no token ids (after the run's clock)."""
        if self.counter is None:
            return
        if count_tokens(results, requests, self.counter) and not self.counted_tokens:
            self.counted_tokens = True
            print(f"the server returned no token ids: tokens counted with the tokenizer at "
                  f"{self.http.tokenizer}", file=sys.stderr)


async def _models(session: Any, base: str, headers: dict[str, str],
                  connect_timeout_s: float) -> tuple[int, str]:
    """(status, body) of ``GET /v1/models``, retried until the server answers."""
    import aiohttp

    deadline = time.monotonic() + connect_timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            async with session.get(f"{base}/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=max(left, 0.1))) as resp:
                return resp.status, await resp.text(errors="replace")
        except aiohttp.ClientSSLError as e:
            raise ServerRefused(f"TLS with {base} failed: {e}") from None
        except (aiohttp.ClientConnectionError, TimeoutError):
            if time.monotonic() >= deadline:
                raise EndpointUnreachable(base) from None
            await asyncio.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def _pick_model(status: int, body: str) -> str:
    if status != 200:
        raise ServerRefused(f"GET /v1/models: HTTP {status}: {error_message(body)}")
    try:
        return str(json.loads(body)["data"][0]["id"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise ServerRefused(f"GET /v1/models lists no model: give --model "
                            f"(got {body[:200]!r})") from None


@contextlib.asynccontextmanager
async def connect(cfg: ClientConfig, http: HttpConfig,
                  connect_timeout_s: float = 10.0) -> AsyncIterator[OpenAIBackend]:
    """A backend on an HTTP session to ``cfg.endpoint`` once ``GET /v1/models`` answers (which
    also names the model when ``http.model`` is None): ``EndpointUnreachable`` when nothing
    answers within the timeout, ``ServerRefused`` for a key the server refuses (401, 403) or no
    model."""
    import aiohttp

    base = base_url(cfg.endpoint, cfg.tls_ca)
    tls: ssl.SSLContext | bool = (ssl.create_default_context(cafile=cfg.tls_ca) if cfg.tls_ca
                                  else True)
    connector = aiohttp.TCPConnector(limit=cfg.max_concurrency or 0, ssl=tls)
    async with aiohttp.ClientSession(connector=connector) as session:
        headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        status, body = await _models(session, base, headers, connect_timeout_s)
        if status in (401, 403):
            raise ServerRefused(f"GET /v1/models: HTTP {status}: {error_message(body)} "
                                f"(--api-key)")
        model = http.model or _pick_model(status, body)
        yield OpenAIBackend(session, base, model, http, cfg.api_key)
