"""``spin bench trace``: a step trace grouped by kind of step, with the predicted and measured
gain of speculation."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from spin.bench.trace_report import summarize, table
from spin.policy.outcome import StepOutcome
from spin.router.step_trace import StepTrace, read_trace
from policy.steps import timed_step as _step


def test_kinds_and_gains_are_what_the_steps_measured(tmp_path: Path) -> None:
    trace = StepTrace(tmp_path / "t" / "steps.jsonl")
    for i in range(5):
        trace.write(_step(i % 2 == 0))
    trace.write(_step(True, batch=40, greedy=True))  # a kind with no plain side: no gain row
    off = _step(False)
    trace.write(StepOutcome(off.requests, None, step_s=0.3))  # speculation off: no prediction
    trace.write(_step(True), prefilled={"r2"})  # a request's first step: its own kind
    trace.close()
    report = summarize(read_trace(tmp_path / "t" / "steps.jsonl"))
    assert report["steps"] == 8
    plain, prefill, spec, unplanned, big = report["kinds"]
    assert (prefill["mode"], prefill["steps"]) == ("prefill", 1)
    assert (unplanned["mode"], unplanned["steps"], unplanned["tokens_per_s"]) == (
        "unplanned", 1, pytest.approx(3 / 0.3))
    assert (plain["batch"], plain["decoding"], plain["mode"], plain["steps"]) == (
        "2-3", "sampled", "plain", 2)
    assert plain["tokens_per_s"] == pytest.approx(3 / 0.1)
    assert spec["tokens_per_s"] == pytest.approx(6 / 0.25)
    assert spec["predicted_over_measured"]["step"] == pytest.approx(0.2 / 0.25)
    assert spec["predicted_over_measured"]["draft"] == pytest.approx(1.0)
    assert plain["predicted_over_measured"]["draft"] is None
    assert (big["batch"], big["decoding"]) == ("32-63", "greedy")
    [gain] = report["gain"]
    assert gain["predicted_gain"] == pytest.approx((5 / 0.2) / (3 / 0.1))
    # against every step of the size where no request drafted: 9 tokens in 0.5 s
    assert gain["measured_gain"] == pytest.approx((6 / 0.25) / (9 / 0.5))
    assert "| 2-3 | sampled | 3 / 3 | 0.833x | 1.333x |" in table(report)


def test_the_command_prints_the_tables_and_refuses_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path)
    for i in range(4):
        trace.write(_step(i % 2 == 0))
    trace.close()
    r = subprocess.run([sys.executable, "-m", "spin", "bench", "trace", str(path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "4 steps" in r.stdout and "| 2-3 | sampled | 2 / 2 |" in r.stdout
    r = subprocess.run([sys.executable, "-m", "spin", "bench", "trace", str(tmp_path / "no")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no trace at" in r.stderr
