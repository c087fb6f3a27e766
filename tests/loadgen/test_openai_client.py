"""The OpenAI-compatible backend without our server: its pure parts (endpoint URLs, request
bodies, server-sent events, event timing) and a fake OpenAI server on a loopback port.

The fake server streams deterministic text derived from the prompt in bursts of 1-2 pieces, with
token ids or without (then the client counts tokens with the demo tokenizer), answers chosen
prompts with an HTTP error or an error event mid-stream, and records what it was sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from loadgen.__main__ import main
from loadgen.client import ClientConfig, EndpointUnreachable
from loadgen.openai_client import (HttpConfig, ServerRefused, SseParser, StreamTimer, base_url,
                                   completion_body, connect, error_message)
from loadgen.report import RequestResult
from loadgen.schedule import run_with
from loadgen.workload import Request, build_workload

MODEL = "fake-model"


def pieces(prompt: str, n: int) -> list[str]:
    """The fake server's output text, one piece per token."""
    h = zlib.crc32(prompt.encode())
    return [f" w{(h + 7 * i) % 89}" for i in range(n)]


def bursts(n: int) -> list[int]:
    """Pieces per event: 1, 2, 1, 2, ..."""
    sizes: list[int] = []
    while sum(sizes) < n:
        sizes.append(min(1 + len(sizes) % 2, n - sum(sizes)))
    return sizes


class FakeOpenAI(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.return_ids = True
        self.with_usage = True
        self.http_errors: dict[str, tuple[int, str]] = {}
        self.stream_errors: set[str] = set()
        self.bodies: list[dict] = []
        self.auth: list[str | None] = []
        self.models_status = 200


class Handler(BaseHTTPRequestHandler):
    server: FakeOpenAI

    def log_message(self, *args: object) -> None:
        pass

    def _json(self, status: int, obj: object) -> None:
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/v1/models":
            return self._json(404, {"error": {"message": "no such path"}})
        if self.server.models_status != 200:
            return self._json(self.server.models_status, {"error": {"message": "bad key"}})
        self._json(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        srv = self.server
        srv.bodies.append(body)
        srv.auth.append(self.headers.get("Authorization"))
        if self.path != "/v1/completions":
            return self._json(404, {"error": {"message": "no such path"}})
        if body["prompt"] in srv.http_errors:
            status, message = srv.http_errors[body["prompt"]]
            return self._json(status, {"error": {"message": message, "type": "invalid_request"}})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        text = pieces(body["prompt"], body["max_tokens"])
        h = zlib.crc32(body["prompt"].encode())
        pos, sizes = 0, bursts(len(text))
        for i, size in enumerate(sizes):
            choice = {"index": 0, "text": "".join(text[pos:pos + size]),
                      "finish_reason": "length" if i == len(sizes) - 1 else None}
            if srv.return_ids and body.get("return_token_ids"):
                choice["token_ids"] = [(h + j) % 1000 for j in range(pos, pos + size)]
            pos += size
            self._event({"id": "c", "object": "text_completion", "choices": [choice]})
            if body["prompt"] in srv.stream_errors:
                self._event({"error": {"message": "the verifier went away", "type": "internal"}})
                return
            time.sleep(0.003)
        if srv.with_usage and body.get("stream_options", {}).get("include_usage"):
            self._event({"choices": [], "usage": {
                "prompt_tokens": 3, "completion_tokens": pos, "total_tokens": 3 + pos,
                "speculation": {"steps": len(sizes), "steps_without_speculation": 0,
                                "draft_tokens": 4 * len(sizes), "accepted_tokens": pos - len(sizes),
                                "tau": pos / len(sizes),
                                "drafters": [{"drafter": "fake", "steps": len(sizes),
                                              "draft_tokens": 4 * len(sizes),
                                              "accepted_tokens": pos - len(sizes)}]}}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, obj: dict) -> None:
        self.wfile.write(f"data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    srv = FakeOpenAI()
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(10)


def url(srv: FakeOpenAI) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.mark.parametrize("endpoint,tls,expected", [
    ("localhost:8000", None, "http://localhost:8000"),
    ("localhost:8000", "", "https://localhost:8000"),
    ("http://10.0.0.1:8000/v1", None, "http://10.0.0.1:8000"),
    ("https://api.example.com/v1/", None, "https://api.example.com"),
    ("http://gw:80/proxy/v1", None, "http://gw:80/proxy"),
    ("http://[::1]:9000", None, "http://[::1]:9000"),
])
def test_base_url(endpoint: str, tls: str | None, expected: str) -> None:
    assert base_url(endpoint, tls) == expected


@pytest.mark.parametrize("bad", ["ftp://host:1", "http://host:port", "http://h:1/v1?x=1",
                                 "http://"])
def test_bad_endpoints(bad: str) -> None:
    with pytest.raises(ValueError, match="bad endpoint"):
        base_url(bad)


def test_sse_parser_reassembles_events_split_anywhere() -> None:
    stream = (b'data: {"a": 1}\r\n\r\n: keep-alive\n\ndata: line one\ndata: line two\n\n'
              b'event: x\ndata:no-space\r\rdata: [DONE]\n\ndata: tail')
    for step in (1, 2, 3, 7, len(stream)):
        p, out = SseParser(), []
        for i in range(0, len(stream), step):
            out += p.feed(stream[i:i + step])
        out += p.flush()
        assert out == ['{"a": 1}', "line one\nline two", "no-space", "[DONE]", "tail"], step


def events(*objs: object) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def test_stream_timer_times_token_events_like_the_grpc_client() -> None:
    res = RequestResult(index=4)
    t = StreamTimer(res, start=10.0)
    stream = events(
        {"choices": [{"index": 0, "text": "", "token_ids": []}]},          # role-only: no token
        {"choices": [{"index": 0, "text": "ab", "token_ids": [1, 2]}]},
        {"choices": [{"index": 0, "text": "c", "token_ids": [3]}]},
        {"choices": [{"index": 0, "text": "", "token_ids": [],
                      "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "speculation": {
            "steps": 2, "steps_without_speculation": 0, "draft_tokens": 6, "accepted_tokens": 1,
            "drafters": [{"drafter": "d", "steps": 2, "draft_tokens": 6, "accepted_tokens": 1}]}}},
        "[DONE]", {"choices": [{"text": "ignored"}]})
    going = [t.event(data, 10.0 + 0.5 * i) for i, data in enumerate(stream)]
    assert going == [True, True, True, True, True, False, False]
    t.close()
    assert res.ok and res.error_code is None
    assert res.token_ids == [1, 2, 3] and res.text == "abc"
    assert res.ttft_s == pytest.approx(0.5) and res.itls_s == pytest.approx([0.5])
    assert res.e2e_s == pytest.approx(1.5)
    assert res.prompt_tokens == 9
    assert res.speculation.steps == 2 and res.speculation.drafters["d"].accepted_tokens == 1


def test_stream_timer_without_token_ids_times_text_events() -> None:
    res = RequestResult(index=0)
    t = StreamTimer(res, start=0.0)
    for i, data in enumerate(events({"choices": [{"text": "x"}]}, {"choices": [{"text": ""}]},
                                    {"choices": [{"text": "yz", "finish_reason": "stop"}]})):
        t.event(data, 1.0 + i)
    t.close()
    assert res.ok and res.token_ids == [] and res.text == "xyz"
    assert res.ttft_s == 1.0 and res.itls_s == [2.0] and res.e2e_s == 3.0


@pytest.mark.parametrize("stream,code,message", [
    (events({"choices": [{"text": "a"}]}, {"error": {"message": "boom", "type": "internal"}}),
     "STREAM_ERROR", "boom"),
    (events({"choices": [{"text": "a"}]}, "[DONE]"), "INCOMPLETE_STREAM", "without a finish"),
    (["{not json"], "BAD_EVENT", "not JSON"),
    (["[1, 2]"], "BAD_EVENT", "not an object"),
])
def test_stream_timer_failures(stream: list[str], code: str, message: str) -> None:
    res = RequestResult(index=0)
    t = StreamTimer(res, start=0.0)
    for data in stream:
        if not t.event(data, 1.0):
            break
    t.close()
    assert not res.ok and res.error_code == code and message in res.error_message


@pytest.mark.parametrize("body,message", [
    ('{"error": {"message": "bad prompt", "type": "invalid_request_error"}}', "bad prompt"),
    ('{"object": "error", "message": "vllm says no"}', "vllm says no"),
    ('{"detail": "Not Found"}', "Not Found"),
    ("upstream connect error", "upstream connect error"),
])
def test_error_message(body: str, message: str) -> None:
    assert error_message(body) == message


def test_completion_body_sends_speculation_only_when_asked() -> None:
    req = Request(index=3, domain="code", prompt="p", arrival_s=0.0)
    plain = completion_body(ClientConfig("h:1", 8), HttpConfig(), "m", req)
    assert plain == {"model": "m", "prompt": "p", "max_tokens": 8, "stream": True,
                     "stream_options": {"include_usage": True}, "temperature": 0.0,
                     "top_p": 1.0, "ignore_eos": True, "return_token_ids": True}
    sampled = completion_body(ClientConfig("h:1", 8, temperature=0.7, seed=5, top_p=0.9,
                                           ignore_eos=False), HttpConfig(), "m", req)
    assert sampled["seed"] == 8 and sampled["top_p"] == 0.9 and sampled["ignore_eos"] is False
    assert "speculation" not in sampled
    auto = completion_body(ClientConfig("h:1", 8), HttpConfig(send_speculation=True), "m", req)
    assert auto["speculation"] == {"mode": "auto"}
    named = completion_body(ClientConfig("h:1", 8, speculation="draft-code", k=3, early_stop=True),
                            HttpConfig(), "m", req)
    assert named["speculation"] == {"mode": "drafter", "drafter": "draft-code", "k": 3,
                                    "early_stop": True}
    off = completion_body(ClientConfig("h:1", 8, speculation="off"), HttpConfig(), "m", req)
    assert off["speculation"] == {"mode": "off"}


def test_http_errors_fail_only_their_request(fake: FakeOpenAI, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    prompts = [f"prompt number {i}" for i in range(6)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    fake.http_errors = {prompts[1]: (400, "max_tokens is too large for this model")}
    fake.stream_errors = {prompts[4]}
    out = tmp_path / "r.json"
    code = main(["--backend", "openai", "--endpoint", url(fake) + "/v1", "--dataset", str(data),
                 "--num-prompts", "6", "--max-tokens", "6", "--api-key", "sekret",
                 "--json", str(out)])
    assert code == 1
    rep = json.loads(out.read_text())
    assert rep["completed"] == 4 and rep["errors"] == 2
    assert rep["error_codes"] == {"HTTP_400": 1, "STREAM_ERROR": 1}
    assert rep["output_tokens"] == 4 * 6 and rep["prompt_tokens"] == 4 * 3
    assert rep["speculation"]["drafters"]["fake"]["steps"] == 4 * len(bursts(6))
    assert rep["config"]["model"] == MODEL
    err = capsys.readouterr().err
    assert "failed: HTTP_400: max_tokens is too large for this model" in err
    assert "failed: STREAM_ERROR: the verifier went away" in err
    assert set(fake.auth) == {"Bearer sekret"}
    assert {b["model"] for b in fake.bodies} == {MODEL}
    assert all("speculation" not in b for b in fake.bodies)


def test_a_server_without_token_ids_is_counted_with_the_tokenizer(
        fake: FakeOpenAI, family_dir: Path, tokenizer: PreTrainedTokenizerBase) -> None:
    fake.return_ids, fake.with_usage = False, False
    workload = build_workload(5, seed=2)
    cfg = ClientConfig(url(fake), 7)

    async def go() -> list[RequestResult]:
        async with connect(cfg, HttpConfig(tokenizer=str(family_dir / "target"))) as backend:
            assert backend.model == MODEL
            out = await run_with(backend, cfg, workload)
            assert backend.counted_tokens
            return out.results

    results = asyncio.run(go())
    for req, res in zip(workload, results, strict=True):
        text = "".join(pieces(req.prompt, 7))
        assert res.ok and res.text == text
        assert res.token_ids == tokenizer.encode(text, add_special_tokens=False)
        assert res.output_tokens > 7  # " w42" is more than one token of the demo tokenizer
        assert res.prompt_tokens == len(tokenizer.encode(req.prompt, add_special_tokens=False))
        assert len(res.itls_s) == len(bursts(7)) - 1  # one gap per event, not per token
        assert 0 < res.ttft_s <= res.e2e_s
        assert res.speculation.steps == 0
    assert len(fake.bodies) == 5 and all(b["return_token_ids"] for b in fake.bodies)


def test_unreachable_and_refusing_servers(fake: FakeOpenAI,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fake.models_status = 401
    with pytest.raises(ServerRefused, match="HTTP 401: bad key"):
        asyncio.run(_connect_only(url(fake)))
    assert main(["--backend", "openai", "--endpoint", url(fake), "--num-prompts", "1"]) == 2
    assert "the server refused the run: GET /v1/models: HTTP 401" in capsys.readouterr().err
    fake.shutdown()
    fake.server_close()
    with pytest.raises(EndpointUnreachable):
        asyncio.run(_connect_only(url(fake), timeout=0.3))


async def _connect_only(endpoint: str, timeout: float = 5.0) -> None:
    async with connect(ClientConfig(endpoint, 4), HttpConfig(), timeout):
        pass
