"""Both backends against the real embedded deployment (the session's ``serving``): the router's
gRPC API and its OpenAI-compatible HTTP API give the same greedy tokens, and the CLI's sweep
with plots runs end to end over HTTP."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from loadgen import client, openai_client
from loadgen.__main__ import main
from loadgen.client import ClientConfig
from loadgen.openai_client import HttpConfig
from loadgen.report import RequestResult
from loadgen.schedule import run_with
from loadgen.workload import build_workload

N, TOKENS = 8, 16


@pytest.fixture(scope="module")
def http_url(serving) -> str:
    assert serving.router.http_port, "the embedded router serves no HTTP API"
    return f"http://127.0.0.1:{serving.router.http_port}/v1"


def test_both_backends_give_the_same_greedy_tokens(serving, http_url: str) -> None:
    workload = build_workload(N, seed=11)
    grpc_cfg = ClientConfig(serving.endpoint, TOKENS, max_concurrency=4)
    http_cfg = ClientConfig(http_url, TOKENS, max_concurrency=4)

    async def go() -> tuple[list[RequestResult], list[RequestResult]]:
        async with client.connect(grpc_cfg) as g:
            by_grpc = (await run_with(g, grpc_cfg, workload)).results
        async with openai_client.connect(http_cfg, HttpConfig()) as h:
            assert h.model
            by_http = (await run_with(h, http_cfg, workload)).results
            assert not h.counted_tokens  # ours returns token ids
        return by_grpc, by_http

    by_grpc, by_http = asyncio.run(go())
    for a, b in zip(by_grpc, by_http, strict=True):
        assert a.ok and b.ok, (a.error_message, b.error_message)
        assert len(a.token_ids) == TOKENS and b.token_ids == a.token_ids
        assert b.text  # the HTTP API streams text too
        assert 0 < b.ttft_s <= b.e2e_s and b.start_s is not None
        assert b.prompt_tokens == a.prompt_tokens > 0
        # usage.speculation made it through: every step emits at least one token
        assert 0 < b.speculation.steps <= TOKENS
        assert (b.speculation.accepted_tokens ==
                sum(d.accepted_tokens for d in b.speculation.drafters.values()))


def test_cli_sweeps_over_http_and_plots(serving, http_url: str, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for p, d in [
        ("def read_config(path):\n", "code"), ("The river wound slowly through", "prose"),
        ('{"id": 3, "name":', "structured")]))
    plots, out = tmp_path / "plots", tmp_path / "sweep.json"
    code = main(["--backend", "openai", "--endpoint", http_url, "--dataset", str(data),
                 "--num-prompts", "6", "--max-tokens", "8", "--sweep", "--sweep-fractions",
                 "0.5,2", "--check-lossless", "--plot", str(plots), "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    rep = json.loads(out.read_text())
    assert rep["capacity_requests_per_s"] > 0
    assert [e["fraction_of_capacity"] for e in rep["rates"]] == [0.5, 2.0]
    for e in [rep["saturation"], *rep["rates"]]:
        r = e["report"]
        assert (r["completed"], r["errors"], r["lossless_mismatches"]) == (6, 0, 0)
        assert r["output_tokens"] == 6 * 8 and r["ttft"]["p50_ms"] > 0
    assert rep["rates"][0]["rate_requests_per_s"] == pytest.approx(
        0.5 * rep["capacity_requests_per_s"])
    assert rep["config"]["backend"] == "openai" and rep["config"]["model"]
    names = ["latency_vs_rate.png", "throughput_vs_rate.png", "ttft_cdf.png",
             "acceptance_over_time.png"]
    for name in names:
        png = (plots / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 8000, name
        assert f"wrote {plots / name}" in printed
    assert "Rate sweep" in printed and "inf (sat)" in printed


def test_a_request_the_server_refuses_fails_alone(http_url: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "bad.jsonl"
    # JSON can carry a lone surrogate, which the server refuses with 400
    data.write_text('{"prompt": "def ok():"}\n{"prompt": "bad \\ud800 text"}\n'
                    '{"prompt": "import os"}\n')
    out = tmp_path / "r.json"
    assert main(["--backend", "openai", "--endpoint", http_url, "--dataset", str(data),
                 "--num-prompts", "3", "--max-tokens", "4", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["completed"] == 2 and rep["error_codes"] == {"HTTP_400": 1}
    assert "failed: HTTP_400: the request's text has a lone surrogate" in capsys.readouterr().err
