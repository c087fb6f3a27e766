import math
import statistics
import subprocess
import sys

import pytest

from loadgen.workload import arrival_times, build_workload
from spin.zoo.corpus import heldout_prompts
from spin.zoo.specs import FAMILY_DIR


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(5, math.inf, 1.0, seed=0) == [0.0] * 5


def test_poisson_gaps_have_the_requested_mean() -> None:
    times = arrival_times(4000, rate=20.0, burstiness=1.0, seed=1)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert times[0] == 0.0 and all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.06)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.08)


def test_lower_burstiness_is_burstier() -> None:
    def cv(b: float) -> float:
        t = arrival_times(3000, 10.0, b, seed=2)
        g = [y - x for x, y in zip(t, t[1:])]
        return statistics.stdev(g) / statistics.mean(g)
    assert cv(0.25) > 1.5 > cv(1.0) > cv(4.0)


@pytest.mark.parametrize("rate,burstiness", [(0, 1.0), (-1, 1.0), (1.0, 0.0)])
def test_bad_arrival_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(3, rate, burstiness, seed=0)


def test_workload_is_seeded_and_mixed() -> None:
    a = build_workload(60, rate=5.0, seed=3)
    assert a == build_workload(60, rate=5.0, seed=3)
    assert a != build_workload(60, rate=5.0, seed=4)
    assert {r.domain for r in a} == {"code", "prose", "structured"}
    prompts = {r["prompt"] for r in heldout_prompts(FAMILY_DIR)}
    assert all(r.prompt in prompts for r in a)


def test_cli_summary_and_errors() -> None:
    ok = subprocess.run([sys.executable, "-m", "loadgen", "--num-prompts", "9", "--rate", "3", "--dry-run"],
                        capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.startswith("9 requests over")
    bad = subprocess.run([sys.executable, "-m", "loadgen", "--num-prompts", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--num-prompts must be > 0" in bad.stderr
