"""The OpenAI-compatible API of a running ``spin serve`` (the CLI, with an API key), as its users
reach it: the official ``openai`` client unchanged, ``curl -N``, and gRPC beside it.

A second ``spin serve`` with TLS checks HTTPS and gRPC over TLS with the same key.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import shutil
import signal
import ssl
import subprocess
import sys
from pathlib import Path
from xml.etree import ElementTree

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service_helpers import request

from spin.rpc import credentials
from spin.v1 import generation_pb2_grpc

KEY = "test-key-0123"
PROMPT = "def parse(path):\n    with open(path) as f:\n"


class Served:
    def __init__(self, proc: subprocess.Popen, grpc_endpoint: str, http: str) -> None:
        self.proc, self.grpc, self.http = proc, grpc_endpoint, http


def _start(log_dir: Path, *extra: str) -> Served:
    proc = subprocess.Popen(
        [sys.executable, "-m", "spin", "serve", "--port", "0", "--log-dir", str(log_dir),
         "--drafters", "draft-code", "--no-redis", "--api-key", KEY, "--max-batch", "4",
         "--max-queue", "4", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    endpoint = http = ""
    for line in proc.stdout:
        if m := re.match(r"SPIN serving on (\S+)", line):
            endpoint = m.group(1)
        elif m := re.match(r"OpenAI-compatible API on (\S+)/v1", line):
            http = m.group(1)
        elif line.startswith("try:"):
            break
    if not (endpoint and http):
        proc.kill()
        raise AssertionError(proc.stderr.read()[-3000:])
    return Served(proc, endpoint, http)


def _stop(s: Served) -> None:
    s.proc.send_signal(signal.SIGTERM)
    try:
        s.proc.wait(60)
    except subprocess.TimeoutExpired:
        s.proc.kill()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    s = _start(tmp_path_factory.mktemp("serve"))
    yield s
    _stop(s)


@pytest.fixture(scope="module")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.http}/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _grpc_ids(endpoint: str, tls_ca: str | None = None, **kw) -> list[int]:
    with credentials.channel(endpoint, tls_ca) as ch:
        ids: list[int] = []
        for msg in generation_pb2_grpc.GenerationStub(ch).Generate(
                request(**kw), timeout=120, metadata=credentials.metadata(KEY)):
            ids += msg.token_ids
    return ids


def test_models_lists_the_target_and_its_drafters(client: openai.OpenAI, served: Served) -> None:
    models = client.models.list().data
    assert len(models) == 1 and models[0].id == "target"
    assert {"draft-code", "prompt-lookup"} <= set(models[0].model_extra["drafters"])


def test_greedy_completion_equals_the_grpc_api_token_for_token(client: openai.OpenAI,
                                                               model: str, served: Served) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    choice = out.choices[0]
    grpc_ids = _grpc_ids(served.grpc, prompt=PROMPT, max_tokens=40, ignore_eos=True)
    assert choice.model_extra["token_ids"] == grpc_ids
    assert out.usage.completion_tokens == len(grpc_ids) and choice.finish_reason in ("length",
                                                                                      "stop")
    spec = out.usage.model_extra["speculation"]
    assert spec["steps"] >= 1 and spec["tau"] >= 1.0


def test_chat_renders_the_template_and_equals_grpc(client: openai.OpenAI, model: str,
                                                   served: Served) -> None:
    messages = [{"role": "system", "content": "You write Python."},
                {"role": "user", "content": "def main():"}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                         temperature=0, extra_body={"return_token_ids": True})
    prompt = "system: You write Python.\nuser: def main():\nassistant: "  # the demo template
    assert out.choices[0].model_extra["token_ids"] == _grpc_ids(served.grpc, prompt=prompt,
                                                                max_tokens=24)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


def test_streaming_gives_the_same_text_and_usage_last(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "import os"}], max_tokens=32,
        temperature=0)
    chunks = list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "import os"}], max_tokens=32,
        temperature=0, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] in ("length", "stop")


def test_curl_streams_server_sent_events(served: Served, model: str) -> None:
    if shutil.which("curl") is None:
        pytest.skip("no curl")
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                       "stream": True})
    out = subprocess.run(["curl", "-sS", "-N", f"{served.http}/v1/completions", "-H",
                          f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json",
                          "-d", body], capture_output=True, text=True, timeout=120, check=True)
    events = [line.removeprefix("data: ") for line in out.stdout.splitlines() if line]
    assert events[-1] == "[DONE]"
    first = json.loads(events[0])
    assert first["object"] == "text_completion" and first["choices"][0]["index"] == 0
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])


def test_n_choices_with_a_seed_are_the_single_requests_with_seed_plus_i(
        client: openai.OpenAI, model: str) -> None:
    # speculation off: a sampled output then depends on the seed alone (with speculation, on
    # the drafts too: the same distribution, not the same tokens)
    extra = {"return_token_ids": True, "speculation": {"mode": "off"}}
    both = client.completions.create(model=model, prompt=PROMPT, max_tokens=16, n=2,
                                     temperature=0.8, seed=5, extra_body=extra)
    assert [c.index for c in both.choices] == [0, 1]
    assert both.choices[0].model_extra["token_ids"] != both.choices[1].model_extra["token_ids"]
    for i, choice in enumerate(both.choices):
        alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=16,
                                          temperature=0.8, seed=5 + i, extra_body=extra)
        assert choice.model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    assert both.usage.prompt_tokens == alone.usage.prompt_tokens  # the prompt counted once


def test_logprobs_of_completions_and_chat(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == out.usage.completion_tokens
    assert "".join(lp.tokens) == out.choices[0].text
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) <= 3 and abs(max(top.values()) - value) < 1e-4  # greedy
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "x = 1"}], max_tokens=8,
        temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
               for t in content)


def test_per_request_speculation_and_its_stats(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"speculation": {"mode": "drafter", "drafter": "draft-code", "k": 4}})
    spec = out.usage.model_extra["speculation"]
    assert [d["drafter"] for d in spec["drafters"]] == ["draft-code"]
    off = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                    extra_body={"speculation": {"mode": "off"}})
    assert off.choices[0].text == out.choices[0].text  # lossless
    assert off.usage.model_extra["speculation"]["draft_tokens"] == 0


def test_errors_are_openai_error_objects(client: openai.OpenAI, model: str,
                                         served: Served) -> None:
    cases = [
        (openai.BadRequestError, dict(prompt=PROMPT, max_tokens=8, temperature=-1)),
        (openai.BadRequestError, dict(prompt=PROMPT, max_tokens=10**6)),
        (openai.BadRequestError, dict(prompt=PROMPT, max_tokens=8, extra_body={
            "speculation": {"mode": "drafter", "drafter": "nope"}})),
        (openai.BadRequestError, dict(prompt=PROMPT, max_tokens=8, echo=True)),
        (openai.NotFoundError, dict(prompt=PROMPT, max_tokens=8, model="gpt-nope")),
    ]
    for error, kw in cases:
        with pytest.raises(error) as e:
            client.completions.create(**{"model": model, **kw})
        body = e.value.body
        assert set(body) >= {"message", "type"} and body["message"], body
    anonymous = openai.OpenAI(base_url=f"{served.http}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.models.list()
    assert e.value.body["code"] == "invalid_api_key"


def test_a_full_queue_answers_429(client: openai.OpenAI, model: str) -> None:
    def one(_: int) -> str:
        try:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=48, temperature=0,
                                      extra_body={"ignore_eos": True})
        except openai.RateLimitError as e:
            assert e.body["type"] == "rate_limit_error"
            return "429"
        return "ok"

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outcomes = list(pool.map(one, range(16)))  # batch 4 + queue 4
    assert outcomes.count("429") > 0 and outcomes.count("ok") >= 8


def test_grpc_needs_the_key_and_health_does_not(served: Served) -> None:
    with grpc.insecure_channel(served.grpc) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(generation_pb2_grpc.GenerationStub(ch).Generate(request(PROMPT, max_tokens=4),
                                                                 timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    assert len(_grpc_ids(served.grpc, prompt=PROMPT, max_tokens=4)) == 4


def test_health_and_openapi_need_no_key(served: Served) -> None:
    import urllib.request

    with urllib.request.urlopen(f"{served.http}/health", timeout=10) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"{served.http}/openapi.json", timeout=10) as r:
        spec = json.loads(r.read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(spec["paths"])


@pytest.fixture
def short_context(tmp_path: Path):
    """A server whose context is 128 tokens: a chat request without ``max_tokens`` generates
    what the context leaves, so against the default context each fuzzed request ran to the
    model's whole context (the same 34 cases fuzzed in 74 s there, 9 s here)."""
    s = _start(tmp_path / "serve", "--max-model-len", "128")
    yield s
    _stop(s)


def test_schemathesis_finds_no_server_error_and_no_schema_violation(short_context: Served,
                                                                     tmp_path: Path) -> None:
    st = shutil.which("schemathesis") or str(Path(sys.executable).parent / "schemathesis")
    report = tmp_path / "junit.xml"
    served = short_context
    run = subprocess.run(
        [st, "run", f"{served.http}/openapi.json", "--header", f"Authorization: Bearer {KEY}",
         "--checks", "not_a_server_error,response_schema_conformance,status_code_conformance,"
         "content_type_conformance", "--max-examples", "15", "--phases", "examples,fuzzing",
         "--request-timeout", "120", "--report", "junit", "--report-junit-path", str(report),
         "--seed", "1"], capture_output=True, text=True, timeout=900, cwd=tmp_path)
    print(run.stdout[-2500:])
    # the failures (request bodies of fuzzed JSON can be long: their lines are cut)
    failures = "\n".join(line[:400] for line in run.stdout.splitlines())
    assert run.returncode == 0, failures[-8000:] + run.stderr[-2000:]
    # every operation was fuzzed (a run that tested nothing would also exit 0)
    tested = {c.get("name") for c in ElementTree.parse(report).iter("testcase")}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"} <= tested


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory):
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    s = _start(d / "serve", "--tls-cert", str(d / "cert.pem"), "--tls-key", str(d / "key.pem"))
    yield s, str(d / "cert.pem")
    _stop(s)


def test_tls_on_grpc_and_http(tls) -> None:
    s, ca = tls
    assert s.http.startswith("https://")
    client = openai.OpenAI(base_url=f"{s.http}/v1", api_key=KEY, max_retries=0,
                           http_client=openai.DefaultHttpxClient(
                               verify=ssl.create_default_context(cafile=ca)))
    out = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    assert out.choices[0].model_extra["token_ids"] == _grpc_ids(s.grpc, tls_ca=ca, prompt=PROMPT,
                                                                max_tokens=12)
    with pytest.raises(grpc.RpcError):  # plaintext to a TLS port fails
        _grpc_ids(s.grpc, prompt=PROMPT, max_tokens=2)


@pytest.mark.timing  # stops within a deadline: `make test-busy`
def test_sigterm_lets_a_running_stream_finish_and_stops_promptly(client: openai.OpenAI,
                                                                 model: str,
                                                                 served: Served) -> None:
    """Last: it stops the module's deployment. A stream running at SIGTERM gets all its tokens;
    the idle keep-alive connection the client holds does not delay the stop (it held it 30 s:
    the deadline counts from the stream's end, since the 120 tokens' own time depends on how
    busy the machine is: 25 s from the signal beside two busy processes once)."""
    import time

    tokens, stopped_at = 0, None
    for chunk in client.completions.create(
            model=model, prompt=PROMPT, max_tokens=120, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        if chunk.choices:
            tokens += len(chunk.choices[0].model_extra["token_ids"])
        if stopped_at is None:
            stopped_at = time.monotonic()
            served.proc.send_signal(signal.SIGTERM)
    ended = time.monotonic()
    assert tokens == 120
    assert served.proc.wait(60) == 0
    assert time.monotonic() - ended < 20
