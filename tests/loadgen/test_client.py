"""The load generator against a real gRPC server: a fake router on a loopback port.

The fake router streams deterministic tokens derived from the prompt, in bursts of 1-3 tokens
(one token per message without speculation), rejects chosen prompts with INVALID_ARGUMENT, and
answers a chosen prompt differently without speculation (a lossless-check failure).
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from loadgen.__main__ import main
from loadgen.client import ClientConfig, run
from loadgen.workload import build_workload
from spin.v1 import generation_pb2, generation_pb2_grpc

MAX_TOKENS = 12


def fake_tokens(prompt: str, n: int, diverge: bool) -> list[int]:
    """The fake target's output; ``diverge`` changes the last token."""
    h = zlib.crc32(prompt.encode())
    tokens = [(h + 31 * i) % 50_000 for i in range(n)]
    if diverge:
        tokens[-1] = (tokens[-1] + 1) % 50_000
    return tokens


def fake_bursts(prompt: str, n: int, speculate: bool) -> list[int]:
    """Tokens per message: 1-3 (seeded by the prompt) with speculation, else 1."""
    if not speculate:
        return [1] * n
    rng, sizes = random.Random(zlib.crc32(prompt.encode())), []
    while sum(sizes) < n:
        sizes.append(min(rng.randint(1, 3), n - sum(sizes)))
    return sizes


class FakeRouter(generation_pb2_grpc.GenerationServicer):
    """Implements Generate; runs on the server thread's event loop only."""

    def __init__(self) -> None:
        self.fail_prompts: set[str] = set()
        self.diverge_prompts: set[str] = set()
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.active = 0
        self.peak = 0

    async def Generate(self, request: generation_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> None:
        self.requests.append(request)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(0.002)
            if request.prompt in self.fail_prompts:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt rejected by test")
            off = request.speculation.mode == generation_pb2.SPECULATION_MODE_OFF
            tokens = fake_tokens(request.prompt, request.max_tokens,
                                 off and request.prompt in self.diverge_prompts)
            bursts = fake_bursts(request.prompt, request.max_tokens, not off)
            pos = 0
            for i, size in enumerate(bursts):
                msg = generation_pb2.GenerateResponse(request_id=request.request_id,
                                                      token_ids=tokens[pos:pos + size])
                pos += size
                if i == len(bursts) - 1:
                    steps = len(bursts)
                    accepted = 0 if off else pos - steps
                    msg.finish_reason = generation_pb2.FINISH_REASON_LENGTH
                    msg.usage.prompt_tokens = len(request.prompt.split())
                    msg.usage.completion_tokens = pos
                    s = msg.speculation
                    s.steps, s.tau = steps, pos / steps
                    s.steps_without_speculation = steps if off else 0
                    if not off:
                        s.draft_tokens, s.accepted_tokens = 3 * steps, accepted
                        s.drafters.add(drafter="fake", steps=steps, draft_tokens=3 * steps,
                                       accepted_tokens=accepted)
                yield msg
                await asyncio.sleep(0.003)
        finally:
            self.active -= 1


@pytest.fixture
def router() -> Iterator[tuple[str, FakeRouter]]:
    """A grpc.aio server with a FakeRouter on 127.0.0.1, on its own thread and event loop."""
    servicer = FakeRouter()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start() -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    try:
        yield f"127.0.0.1:{port}", servicer
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_cli_run_counts_errors_mismatches_and_respects_concurrency(
        router: tuple[str, FakeRouter], tmp_path: Path) -> None:
    endpoint, servicer = router
    n, seed = 10, 3
    workload = build_workload(n, seed=seed)
    assert len({r.prompt for r in workload}) == n  # so one prompt = one request
    servicer.fail_prompts = {workload[2].prompt}
    servicer.diverge_prompts = {workload[5].prompt}
    out = tmp_path / "report.json"
    code = main(["--endpoint", endpoint, "--num-prompts", str(n), "--seed", str(seed),
                 "--max-tokens", str(MAX_TOKENS), "--max-concurrency", "3", "--check-lossless",
                 "--slo", "ttft:60000,tpot:60000", "--json", str(out)])
    assert code == 1
    rep = json.loads(out.read_text())
    assert rep["completed"] == 9 and rep["errors"] == 1
    assert rep["error_codes"] == {"INVALID_ARGUMENT": 1}
    assert rep["lossless_mismatches"] == 1
    assert rep["lossless_errors"] == 1  # the rejected prompt fails in the reference run too
    assert rep["output_tokens"] == 9 * MAX_TOKENS
    ok = [r for r in workload if r.index != 2]
    assert rep["prompt_tokens"] == sum(len(r.prompt.split()) for r in ok)
    steps = sum(len(fake_bursts(r.prompt, MAX_TOKENS, True)) for r in ok)
    assert rep["speculation"]["steps"] == steps
    assert rep["speculation"]["accepted_tokens"] == 9 * MAX_TOKENS - steps
    assert rep["speculation"]["drafters"]["fake"]["draft_tokens"] == 3 * steps
    assert rep["tau"] == pytest.approx(9 * MAX_TOKENS / steps)
    assert rep["goodput"]["requests"] == 9
    for stat in ("mean_ms", "p50_ms", "p99_ms"):
        assert 0 < rep["ttft"][stat] <= rep["e2e"][stat]
        assert rep["itl"][stat] > 0 and rep["tpot"][stat] > 0
    assert rep["config"]["max_concurrency"] == 3 and rep["config"]["rate"] == "inf"
    assert servicer.peak == 3
    assert len(servicer.requests) == 2 * n
    main_req, ref_req = servicer.requests[0], servicer.requests[-1]
    assert main_req.speculation.mode == generation_pb2.SPECULATION_MODE_AUTO
    assert main_req.ignore_eos and main_req.max_tokens == MAX_TOKENS
    assert not main_req.sampling.HasField("seed") and main_req.sampling.temperature == 0
    assert ref_req.speculation.mode == generation_pb2.SPECULATION_MODE_OFF
    assert {r.request_id for r in servicer.requests[:n]} == {f"loadgen-3-{i}" for i in range(n)}


def test_cli_exits_0_on_a_clean_run(router: tuple[str, FakeRouter], tmp_path: Path) -> None:
    endpoint, servicer = router
    out = tmp_path / "report.json"
    assert main(["--endpoint", endpoint, "--num-prompts", "8", "--max-tokens", "5",
                 "--rate", "200", "--check-lossless", "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert (rep["completed"], rep["errors"], rep["lossless_mismatches"]) == (8, 0, 0)
    assert rep["output_tokens"] == 40 and rep["goodput"] is None
    assert servicer.peak >= 1


def test_per_request_timing_tokens_and_sampling(router: tuple[str, FakeRouter]) -> None:
    endpoint, servicer = router
    workload = build_workload(6, seed=7)
    cfg = ClientConfig(endpoint, MAX_TOKENS, temperature=0.7, seed=7, speculation="draft-code",
                       ignore_eos=False)
    outcome = asyncio.run(run(cfg, workload))
    assert outcome.reference is None
    for req, res in zip(workload, outcome.results, strict=True):
        assert res.ok and res.index == req.index
        assert res.token_ids == fake_tokens(req.prompt, MAX_TOKENS, False)
        bursts = fake_bursts(req.prompt, MAX_TOKENS, True)
        assert len(res.itls_s) == len(bursts) - 1  # one gap per message, not per token
        assert 0 < res.ttft_s <= res.e2e_s
        assert res.tpot_s == pytest.approx((res.e2e_s - res.ttft_s) / (MAX_TOKENS - 1))
        assert res.speculation.steps == len(bursts)
    by_id = {r.request_id: r for r in servicer.requests}
    for req in workload:
        sent = by_id[f"loadgen-7-{req.index}"]
        assert sent.sampling.HasField("seed") and sent.sampling.seed == 7 + req.index
        assert sent.sampling.temperature == pytest.approx(0.7)
        assert sent.speculation.mode == generation_pb2.SPECULATION_MODE_DRAFTER
        assert sent.speculation.drafter == "draft-code" and not sent.ignore_eos
    assert servicer.peak == 6  # unlimited concurrency, all at once


def test_unreachable_router_fails_fast(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"127.0.0.1:{port}"
    assert main(["--endpoint", endpoint, "--num-prompts", "2", "--connect-timeout", "0.5"]) == 2
    assert f"cannot reach the router at {endpoint}: start it with `spin serve`" in \
        capsys.readouterr().err


@pytest.mark.parametrize("args,message", [
    (["--num-prompts", "0"], "--num-prompts must be > 0"),
    (["--max-tokens", "-1"], "--max-tokens must be > 0"),
    (["--rate", "0"], "--rate must be > 0"),
    (["--burstiness", "0"], "--burstiness must be > 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be > 0"),
    (["--temperature", "0.5", "--check-lossless"], "needs --temperature 0"),
    (["--slo", "ttft=200"], "--slo: bad SLO 'ttft=200'"),
    (["--top-p", "0"], "--top-p must be in (0, 1] (got 0.0)"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1] (got 1.5)"),
    (["--sweep", "--rate", "4"], "--sweep picks its own rates"),
    (["--sweep-rates", "1,2"], "--sweep-fractions and --sweep-rates need --sweep"),
    (["--sweep", "--sweep-rates", "1", "--sweep-fractions", "1"], "not both"),
    (["--sweep", "--sweep-fractions", "0.5,0"], "--sweep-fractions: every value must be"),
    (["--sweep", "--sweep-rates", "x"], "--sweep-rates: 'x' is not a number"),
    (["--model", "m"], "--model is for --backend openai"),
    (["--backend", "openai", "--endpoint", "http://h:1", "--tls-ca"], "needs an https://"),
    (["--backend", "openai", "--endpoint", "ftp://h:1"], "--endpoint: bad endpoint"),
    (["--tls-ca", "/no/such/ca.pem"], "--tls-ca: no such file: /no/such/ca.pem"),
    (["--backend", "nope"], "invalid choice: 'nope'"),
    (["--k", "-1"], "--k must be >= 0"),
])
def test_bad_arguments(args: list[str], message: str,
                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_workload_printing_needs_no_network(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--num-prompts", "3", "--jsonl", "--endpoint", "127.0.0.1:1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert main(["--num-prompts", "9", "--rate", "3", "--dry-run"]) == 0
    assert capsys.readouterr().out.startswith("9 requests over")


def test_run_workload_on_a_stub_keeps_its_arrival_times(router: tuple[str, FakeRouter]) -> None:
    """``run_workload(stub, ...)``, as ``spin bench policy`` calls it."""
    from loadgen.client import run_workload

    endpoint, _ = router
    workload = build_workload(5, rate=50.0, seed=4)

    async def go():
        async with grpc.aio.insecure_channel(endpoint) as channel:
            return await run_workload(generation_pb2_grpc.GenerationStub(channel), workload,
                                      ClientConfig(endpoint, 4), "x", progress=False)

    results, wall = asyncio.run(go())
    assert [r.token_ids for r in results] == [fake_tokens(r.prompt, 4, False) for r in workload]
    for req, res in zip(workload, results, strict=True):
        assert req.arrival_s <= res.start_s < req.arrival_s + 0.5
        assert res.start_s + res.e2e_s <= wall
