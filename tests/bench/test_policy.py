"""The policy benchmark's accounting: the oracle and the best fixed configuration, chosen on some
passes and timed on another; the pipeline section on a small batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spin.bench.pipeline import pipeline, shared_cores
from spin.bench.policy import PolicyBenchConfig, _best_fixed, _held_out, _medians, _oracle
from spin.router.config import RouterConfig
from spin.serve import Embedded, ServeConfig

# seconds[config][pass][request]: "a" is truly faster on request 0 and "b" on request 1, but in
# pass 1 "b" got lucky on request 0 (a minimum over noise)
E2E = {"off": [[2.0, 2.0], [2.0, 2.0]],
       "a": [[1.0, 1.6], [1.0, 1.6]],
       "b": [[1.2, 1.0], [0.6, 1.0]]}


def test_the_in_sample_oracle_keeps_the_lucky_run() -> None:
    med = {c: _medians(runs) for c, runs in E2E.items()}
    assert med["b"] == [pytest.approx(0.9), 1.0]
    assert _oracle(med) == ["b", "b"]  # b's lucky pass makes it request 0's best
    assert _best_fixed(med) == ["b", "b"]


def test_held_out_times_each_pass_with_the_choice_of_the_others() -> None:
    # pass 0 is timed with pass 1's choice (b: 1.2 s), pass 1 with pass 0's (a: 1.0 s)
    assert _held_out(E2E, _oracle) == [pytest.approx(1.1), 1.0]
    assert _held_out(E2E, _best_fixed) == [pytest.approx(0.9), 1.0]  # b on both: no choice differs
    one = {c: runs[:1] for c, runs in E2E.items()}  # one pass: chosen and timed on it
    assert _held_out(one, _oracle) == [1.0, 1.0]


class SmallBatch(PolicyBenchConfig):
    @property
    def pipeline_requests(self) -> int:
        return 4


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="splitting cores needs 2")
def test_pipeline_section_on_a_small_batch(tmp_path: Path, family_dir: Path) -> None:
    """Shared and split deployments, one and two micro-batches: every output is the target's,
    steps are counted per request (the same in every run), and a step is wall time over them."""
    cfg = SmallBatch(family_dir=family_dir, new_tokens=12)
    with Embedded(ServeConfig(family_dir=family_dir, port=0, drafters=["draft-code"],
                              router=RouterConfig(policy="fixed"), redis=False,
                              log_dir=tmp_path / "shared")) as emb:
        shared = shared_cores(emb, cfg)
    assert set(shared) == {"one", "two"} and shared["one"][0] == shared["two"][0]
    report, mismatches = pipeline(cfg, tmp_path, shared)
    assert mismatches == 0
    assert report["requests"] == 4 and report["cpus"]["verifier"]
    on, one = report["runs"]["on"], report["runs"]["off"]
    assert on["steps"] == one["steps"] > 1
    assert report["step_s"] == pytest.approx(on["wall_s"] / on["steps"])
    assert one["lane_steps"] >= one["steps"] and on["lane_steps"] > on["steps"]  # two lanes
    assert report["max_draft_verify_s"] == max(report["draft_s"], report["verify_s"]) > 0
    assert set(report["tokens_per_s_shared_cores"]) == {"one", "two"}
