"""``--sweep`` (capacity, then fractions of it) against a fake backend of known capacity,
``--plot``'s charts from runs of known numbers, and the new arguments' validation."""

from __future__ import annotations

import asyncio
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest

from loadgen.client import ClientConfig
from loadgen.plot import acceptance_series, write_plots
from loadgen.report import DrafterCounts, RequestResult, SpecCounts
from loadgen.sweep import RunRecord, format_sweep, parse_rates, sweep, sweep_report
from loadgen.workload import Request, build_workload

SERVICE_S = 0.04
"""The fake server's time per request."""
SLOTS = 2
"""Requests it serves at once (so its capacity is SLOTS / SERVICE_S = 50 req/s)."""
PNG = b"\x89PNG\r\n\x1a\n"


class FakeBackend:
    """Serves SLOTS requests at a time, SERVICE_S each; tokens from the prompt, the last one
    different for ``diverge`` prompts without speculation."""

    def __init__(self, diverge: set[str] = frozenset()) -> None:
        self.slots = asyncio.Semaphore(SLOTS)
        self.diverge = diverge
        self.sent: list[tuple[str, str]] = []

    async def send(self, req: Request, cfg: ClientConfig, suffix: str) -> RequestResult:
        self.sent.append((req.prompt, cfg.speculation))
        start = asyncio.get_running_loop().time()
        async with self.slots:
            await asyncio.sleep(SERVICE_S)
        e2e = asyncio.get_running_loop().time() - start
        ids = [zlib.crc32(req.prompt.encode()) % 100 + i for i in range(cfg.max_tokens)]
        if cfg.speculation == "off" and req.prompt in self.diverge:
            ids[-1] += 1
        return RequestResult(index=req.index, ok=True, ttft_s=e2e / 2, e2e_s=e2e, token_ids=ids,
                             prompt_tokens=2)

    def finish(self, results: list[RequestResult], requests: Sequence[Request]) -> None:
        pass


def test_sweep_measures_capacity_then_runs_fractions_of_it() -> None:
    n = 12
    workload = build_workload(n, seed=1)
    backend = FakeBackend(diverge={workload[3].prompt})
    cfg = ClientConfig("fake", 4)

    def make(rate: float) -> list[Request]:
        return build_workload(n, rate, 1.0, seed=1)

    out = asyncio.run(sweep(backend, cfg, make, fractions=(0.5, 2.0), check_lossless=True,
                            progress=False))
    sat, half, double = out.runs
    assert math.isinf(sat.rate) and sat.fraction is None
    assert out.capacity == pytest.approx(n / sat.duration_s)
    # 12 requests, 2 at a time, 40 ms each: 6 waves of 40 ms (a busy machine only slows it)
    assert 0.5 * SLOTS / SERVICE_S < out.capacity <= 1.01 * SLOTS / SERVICE_S
    assert (half.fraction, double.fraction) == (0.5, 2.0)
    assert half.rate == pytest.approx(0.5 * out.capacity)
    assert double.rate == pytest.approx(2 * out.capacity)
    assert half.duration_s >= make(half.rate)[-1].arrival_s  # the arrival schedule was kept
    assert 0 < sat.offset_s < half.offset_s < double.offset_s
    prompts = [p for p, _ in backend.sent]
    assert prompts[:n] == prompts[n:2 * n] == prompts[2 * n:3 * n] == [r.prompt for r in workload]
    assert [s for _, s in backend.sent[3 * n:]] == ["off"] * n  # the reference run, once

    rep = sweep_report(out, config={"seed": 1})
    assert rep["capacity_requests_per_s"] == out.capacity
    assert rep["saturation"]["rate_requests_per_s"] == "inf"
    assert [e["fraction_of_capacity"] for e in rep["rates"]] == [0.5, 2.0]
    for e in [rep["saturation"], *rep["rates"]]:
        assert e["report"]["completed"] == n and e["report"]["lossless_mismatches"] == 1
        assert e["report"]["output_tokens"] == 4 * n
    table = format_sweep(rep)
    assert f"Capacity (saturation run): {out.capacity:.2f} req/s" in table
    rows = [line.split() for line in table.splitlines()[4:7]]  # title, capacity, header, rule
    assert rows[0][:2] == ["inf", "(sat)"]
    assert rows[1][:2] == [f"{half.rate:.2f}", "0.50"]
    assert rows[2][:2] == [f"{double.rate:.2f}", "2.00"]
    assert all(r[-2:] == ["0", "1"] for r in rows)  # failed, mismatches


def test_given_rates_skip_the_saturation_run() -> None:
    backend = FakeBackend()
    out = asyncio.run(sweep(backend, ClientConfig("fake", 2),
                            lambda rate: build_workload(4, rate, seed=0), rates=(40.0, 80.0),
                            progress=False))
    assert out.capacity is None and [r.rate for r in out.runs] == [40.0, 80.0]
    rep = sweep_report(out)
    assert rep["saturation"] is None and len(rep["rates"]) == 2
    assert len(backend.sent) == 8


def test_parse_rates() -> None:
    assert parse_rates("0.25, 1,2", "x") == (0.25, 1.0, 2.0)
    for bad in ("0", "-1", "inf", "nan", "1,,2", "a"):
        with pytest.raises(ValueError, match="^x: "):
            parse_rates(bad, "x")


def done(index: int, start: float, e2e: float,
         drafters: dict[str, tuple[int, int]]) -> RequestResult:
    spec = SpecCounts(drafters={n: DrafterCounts(1, d, a) for n, (d, a) in drafters.items()})
    return RequestResult(index=index, ok=True, start_s=start, ttft_s=e2e / 4, e2e_s=e2e,
                         token_ids=[0] * 8, speculation=spec)


def test_acceptance_is_bucketed_by_completion_time() -> None:
    # 8 completions of two runs, the last at 3.8 s -> 2 buckets of 1.9 s (4 requests each)
    first = [done(i, 0.0, 0.4 * (i + 1), {"a": (4, 3)}) for i in range(4)]           # 0.4 .. 1.6
    second = [done(4 + i, 0.1 * i, 0.5, {"a": (4, 1), "b": (2, 2)}) for i in range(4)]
    runs = [RunRecord("x", math.inf, None, first, 2.0, 0.0),
            RunRecord("y", 10.0, None, second, 1.0, 3.0)]                            # 3.5 .. 3.8
    centres, series = acceptance_series(runs)
    assert centres == pytest.approx([0.95, 2.85])  # t_end 3.8 / 2 buckets
    assert series == {"a": [pytest.approx(0.75), pytest.approx(0.25)], "b": [None, 1.0]}
    no_drafts = [RunRecord("z", 1.0, None, [done(0, 0, 1, {"a": (0, 0)})], 1.0)]
    assert acceptance_series(no_drafts) == ([], {})


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 8000, path


def test_plots_of_a_sweep_and_of_a_single_run(tmp_path: Path) -> None:
    def run(label: str, rate: float, lat: float, offset: float) -> RunRecord:
        res = [done(i, 0.05 * i, lat * (1 + i / 10), {"d": (4, i % 4)}) for i in range(10)]
        return RunRecord(label, rate, None, res, 1.0 + lat, offset)

    runs = [run("saturation", math.inf, 0.9, 0.0), run("2 req/s", 2.0, 0.2, 2.0),
            run("8 req/s", 8.0, 0.5, 4.0)]
    paths, notes = write_plots(tmp_path / "sweep", runs, swept=True)
    assert [p.name for p in paths] == ["latency_vs_rate.png", "throughput_vs_rate.png",
                                       "ttft_cdf.png", "acceptance_over_time.png"]
    assert notes == []
    for p in paths:
        _assert_png(p)
    bare = [RunRecord("rate inf", math.inf, None,
                      [done(i, 0.0, 0.3, {}) for i in range(5)], 0.5)]
    paths, notes = write_plots(tmp_path / "single", bare, swept=False)
    assert [p.name for p in paths] == ["ttft_cdf.png"]
    _assert_png(paths[0])
    assert len(notes) == 2 and "need --sweep" in notes[0] and "no per-drafter" in notes[1]
    assert sorted(f.name for f in (tmp_path / "single").iterdir()) == ["ttft_cdf.png"]
