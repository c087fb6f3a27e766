"""The router's step trace file (``router/step_trace.py``): what a line holds, torn lines, a
disk that fails under it. The lines a serving router writes: ``test_service.py``."""

from __future__ import annotations

from pathlib import Path

from spin.router.step_trace import StepTrace, read_trace, step_record
from policy.steps import timed_step as _step


def test_a_record_holds_the_steps_requests_times_and_prediction() -> None:
    rec = step_record(_step(True), 1.5, prefilled={"r1"})
    assert (rec["t"], rec["batch"], rec["step_s"], rec["draft_s"]) == (1.5, 3, 0.25, {"d": 0.05})
    assert rec["requests"][0] == ["r0", "d", 2, 2, 1, 2, False, False]
    assert rec["requests"][1][7] is True  # r1's first step: it prefilled
    p = rec["predicted"]
    assert (p["plain_s"], p["tokens"], p["scoring_calls"]) == (0.1, 5.0, 0)


def test_a_torn_last_line_is_left_out_and_a_failed_write_stops_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    trace = StepTrace(path)
    trace.write(_step(True))
    trace.close()
    trace.write(_step(False))  # closed: nothing more is written, nothing raises
    with path.open("a") as f:
        f.write('{"t": 1.0, "batch"')  # a router that died mid-line
    assert len(read_trace(path)) == 1
    full = StepTrace("/dev/full")  # every write fails: disk full (ENOSPC)
    full.write(_step(True))  # logged; the trace stops, the router goes on
    assert full._file is None
