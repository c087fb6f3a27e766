"""Statistics of the load generator: percentiles, TPOT, goodput under SLOs, empty runs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from loadgen.report import (DrafterCounts, RequestResult, SpecCounts, build_report, latency_stats,
                            meets_slo, parse_slo, percentile)


def done(index: int, ttft: float, e2e: float, tokens: int, itls: list[float] | None = None,
         prompt_tokens: int = 5, spec: SpecCounts | None = None) -> RequestResult:
    return RequestResult(index=index, ok=True, ttft_s=ttft, e2e_s=e2e, itls_s=itls or [],
                         token_ids=list(range(tokens)), prompt_tokens=prompt_tokens,
                         speculation=spec or SpecCounts())


def failed(index: int, code: str = "UNAVAILABLE") -> RequestResult:
    return RequestResult(index=index, ok=False, error_code=code, error_message="boom")


@pytest.mark.parametrize("values,q,expected", [
    ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
    ([1.0, 2.0, 3.0, 4.0], 99, 3.97),      # pos 2.97: 3 + 0.97 * (4 - 3)
    ([3.0, 1.0, 2.0], 25, 1.5),            # sorted first; pos 0.5
    ([10.0, 20.0], 0, 10.0),
    ([10.0, 20.0], 100, 20.0),
    ([7.0], 99, 7.0),
    ([0.0, 10.0, 20.0, 30.0, 40.0, 100.0], 90, 70.0),  # pos 4.5: 40 + 0.5 * 60
])
def test_percentile_interpolates_linearly(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == pytest.approx(expected)
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_latency_stats_are_in_milliseconds() -> None:
    assert latency_stats([0.001, 0.002, 0.003, 0.004]) == pytest.approx(
        {"mean_ms": 2.5, "p50_ms": 2.5, "p99_ms": 3.97})
    assert latency_stats([]) is None


def test_tpot_excludes_the_first_token() -> None:
    assert done(0, ttft=0.1, e2e=1.0, tokens=10).tpot_s == pytest.approx(0.1)
    assert done(0, ttft=0.2, e2e=0.2, tokens=1).tpot_s is None
    assert failed(0).tpot_s is None


def test_parse_slo() -> None:
    assert parse_slo("ttft:200, tpot:50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_slo("e2e:1500.5") == {"e2e": 1500.5}
    for bad in ("ttft", "ttft:abc", "foo:10", "ttft:0", "ttft:-5", "ttft:10,ttft:20", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_goodput_counts_requests_meeting_every_slo() -> None:
    slo = {"ttft": 100.0, "tpot": 20.0}
    ok = done(0, ttft=0.05, e2e=0.05 + 9 * 0.01, tokens=10)        # ttft 50 ms, tpot 10 ms
    slow_start = done(1, ttft=0.15, e2e=0.15 + 9 * 0.01, tokens=10)  # ttft 150 ms
    slow_tokens = done(2, ttft=0.05, e2e=0.05 + 9 * 0.03, tokens=10)  # tpot 30 ms
    single = done(3, ttft=0.08, e2e=0.08, tokens=1)                  # no TPOT: bound not applicable
    assert [meets_slo(r, slo) for r in (ok, slow_start, slow_tokens, single)] == [
        True, False, False, True]
    assert not meets_slo(failed(4), slo)
    rep = build_report([ok, slow_start, slow_tokens, single, failed(4)], duration_s=2.0, slo=slo)
    assert rep["goodput"] == {"requests": 2, "requests_per_s": 1.0,
                              "slo": {"ttft_ms": 100.0, "tpot_ms": 20.0}}
    assert build_report([ok], 1.0)["goodput"] is None


def test_report_aggregates_latency_throughput_and_speculation() -> None:
    spec_a = SpecCounts(steps=4, steps_without_speculation=1, draft_tokens=9, accepted_tokens=6,
                        drafters={"draft-code": DrafterCounts(3, 9, 6)})
    spec_b = SpecCounts(steps=6, steps_without_speculation=0, draft_tokens=12, accepted_tokens=4,
                        drafters={"draft-code": DrafterCounts(2, 6, 3),
                                  "prompt-lookup": DrafterCounts(4, 6, 1)})
    a = done(0, ttft=0.1, e2e=0.5, tokens=10, itls=[0.1, 0.2, 0.1], prompt_tokens=7, spec=spec_a)
    b = done(1, ttft=0.3, e2e=0.9, tokens=10, itls=[0.4], prompt_tokens=3, spec=spec_b)
    rep = build_report([a, b, failed(2, "INVALID_ARGUMENT"), failed(3, "INVALID_ARGUMENT"),
                        failed(4, "DEADLINE_EXCEEDED")], duration_s=4.0, config={"seed": 1})
    assert rep["completed"] == 2 and rep["errors"] == 3
    assert rep["error_codes"] == {"DEADLINE_EXCEEDED": 1, "INVALID_ARGUMENT": 2}
    assert rep["lossless_mismatches"] is None
    assert rep["ttft"] == pytest.approx({"mean_ms": 200.0, "p50_ms": 200.0, "p99_ms": 298.0})
    assert rep["e2e"] == pytest.approx({"mean_ms": 700.0, "p50_ms": 700.0, "p99_ms": 896.0})
    # tpot: a = 0.4 / 9, b = 0.6 / 9
    assert rep["tpot"]["mean_ms"] == pytest.approx(1000 * 0.5 / 9)
    # ITLs are pooled over requests: [0.1, 0.1, 0.2, 0.4]
    assert rep["itl"] == pytest.approx({"mean_ms": 200.0, "p50_ms": 150.0, "p99_ms": 394.0})
    assert rep["throughput"] == pytest.approx(
        {"requests_per_s": 0.5, "output_tokens_per_s": 5.0, "total_tokens_per_s": 7.5})
    assert rep["tau"] == pytest.approx(20 / 10)
    spec = rep["speculation"]
    assert spec["draft_tokens"] == 21 and spec["accepted_tokens"] == 10
    assert spec["acceptance_rate"] == pytest.approx(10 / 21)
    assert spec["steps"] == 10 and spec["steps_without_speculation"] == 1
    assert spec["drafters"] == {
        "draft-code": {"steps": 5, "draft_tokens": 15, "accepted_tokens": 9,
                       "acceptance_rate": pytest.approx(0.6)},
        "prompt-lookup": {"steps": 4, "draft_tokens": 6, "accepted_tokens": 1,
                          "acceptance_rate": pytest.approx(1 / 6)}}
    assert rep["config"] == {"seed": 1}


def test_empty_and_all_failed_runs_give_null_stats() -> None:
    for results in ([], [failed(0)]):
        rep = build_report(results, duration_s=0.0, slo={"ttft": 10.0}, lossless_mismatches=0)
        assert rep["completed"] == 0
        assert rep["ttft"] is rep["tpot"] is rep["itl"] is rep["e2e"] is None
        assert rep["tau"] is None and rep["speculation"]["acceptance_rate"] is None
        assert rep["throughput"]["requests_per_s"] is None
        assert rep["goodput"]["requests"] == 0
        json.dumps(rep, allow_nan=False)
