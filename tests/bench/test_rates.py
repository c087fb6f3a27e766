"""``spin bench rates``: a sweep (here on one deployment) is lossless and reports what each mode
measured at each rate; the table; the command's refusals."""

from __future__ import annotations

import subprocess
import sys

from spin.bench.grid import OFF_AGAIN, GridConfig
from spin.bench.policy_config import PolicyBenchConfig
from spin.bench.rates import RatesConfig, _sweep, table
from spin.serve import Embedded


def test_a_greedy_sweep_is_lossless_and_divides_what_each_mode_measured(
        serving: Embedded) -> None:
    cfg = RatesConfig(GridConfig(quick=True, temperatures=(0.0,), prompt_sets=("long",),
                                 repeat_off=True), fractions=(0.5, 2.0), requests=4)
    bench = PolicyBenchConfig(family_dir=cfg.grid.family_dir, new_tokens=cfg.grid.new_tokens)
    sweep = _sweep({m: serving.endpoint for m in ("off", "auto", OFF_AGAIN)}, cfg, bench,
                   "long", 0.0)
    assert sweep["requests"] == 4 and sweep["capacity_rps"] == sweep["all_at_once_rps"]["off"]
    assert [p["load_fraction"] for p in sweep["rates"]] == [0.5, 2.0]
    for point in sweep["rates"]:
        m = point["modes"]
        assert point["greedy_mismatches"] == 0  # every mode's outputs equal off's, at any rate
        assert point["rate_rps"] == point["load_fraction"] * sweep["capacity_rps"]
        assert point["auto_over_off_latency"] == (m["auto"]["mean_latency_s"]
                                                  / m["off"]["mean_latency_s"])
        assert all(0 < v["mean_latency_s"] <= v["p99_latency_s"] for v in m.values())
    report = {"config": {"repeat_off": True}, "sweeps": [sweep]}
    rows = table(report).splitlines()
    assert len(rows) == 4 and rows[2].startswith("| long | 0 | 0.5 |")
    assert rows[3].endswith(f" {sweep['rates'][1]['off_again_over_off_latency']:.3f}x |")


def test_the_command_refuses_what_it_cannot_sweep() -> None:
    for flags, says in ((["--fractions", "0,1"], "--fractions wants numbers > 0"),
                        (["--prompts", "medium"], "--prompts takes short, long or both")):
        r = subprocess.run([sys.executable, "-m", "spin", "bench", "rates", *flags],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and says in r.stderr, r.stderr


def test_the_command_takes_a_step_trace_as_the_grid_does() -> None:
    from pathlib import Path

    from spin.cli import parser

    args = parser().parse_args(["bench", "rates", "--trace", "steps.jsonl", "--prompts", "long"])
    assert args.trace == Path("steps.jsonl") and args.prompts == "long"
