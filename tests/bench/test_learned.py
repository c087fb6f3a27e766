"""``spin bench learned``: its timed prompts, its reading of the step trace and its command
line (the deployment's run itself is ``spin bench policy``'s warm-up and ``run_requests``)."""

from __future__ import annotations

import pytest

from spin.bench import learned
from spin.bench.learned import (LearnedBenchConfig, report, request_sequences, step_table,
                                summary, timed_workload)
from spin.cli import main
from loadgen.workload import build_workload


def _step(requests: list[list], step_s: float, predicted: float | None = None) -> dict:
    return {"step_s": step_s, "requests": requests,
            "predicted": None if predicted is None else {"step_s": predicted}}


# two requests one after another: a's prefill, a head step, a plain step; b's prefill, two
# steps of prompt lookup
RECORDS = [
    _step([["a", "prompt-lookup", 3, 3, 0, 1, False, True]], 0.100),
    _step([["a", "eagle", 4, 4, 3, 4, False, False]], 0.030, 0.025),
    _step([["a", None, 0, 0, 0, 1, False, False]], 0.014, 0.013),
    _step([["b", "prompt-lookup", 3, 3, 0, 1, False, True]], 0.090),
    _step([["b", "prompt-lookup", 3, 3, 2, 3, False, False]], 0.020),
    _step([["b", "prompt-lookup", 3, 3, 0, 1, False, False]], 0.016),
]


def test_the_step_table_leaves_out_prefills_and_counts_each_drafter_and_k() -> None:
    rows = {(r["drafter"], r["k"]): r for r in step_table(RECORDS)}
    assert set(rows) == {("eagle", 4), ("-", 0), ("prompt-lookup", 3)}
    pl = rows[("prompt-lookup", 3)]
    assert pl["steps"] == 2 and pl["step_ms"] == pytest.approx(18.0) and pl["accepted"] == 1.0
    assert pl["predicted_ms"] is None
    assert rows[("eagle", 4)]["predicted_ms"] == pytest.approx(25.0)


def test_each_request_is_a_sequence_from_its_prefill() -> None:
    assert request_sequences(RECORDS) == ["promp3/0 eagle4/3 -0/0", "promp3/0 promp3/2 promp3/0"]


def test_the_report_divides_medians_and_slices_each_modes_steps() -> None:
    cfg = LearnedBenchConfig(passes=2)
    seconds = {"off": [10.0, 12.0], "fixed": [8.0, 8.0], "auto": [9.0, 11.0]}
    spans = {"off": [(0, 0), (0, 0)], "fixed": [(0, 3), (3, 3)], "auto": [(3, 6), (6, 6)]}
    r = report(cfg, seconds, spans, RECORDS, "trace.jsonl")
    assert r["auto_over_fixed"] == pytest.approx(8.0 / 10.0)
    assert r["auto_over_off"] == pytest.approx(11.0 / 10.0)
    assert r["fixed_over_off"] == pytest.approx(11.0 / 8.0)
    assert [row["drafter"] for row in r["steps"]["fixed"]] == ["-", "eagle"]
    assert r["steps"]["off"] == [] and r["auto_requests"] == [["promp3/0 promp3/2 promp3/0"], []]
    assert "auto / eagle:k4 0.800x" in summary(r)


def test_the_timed_prompts_are_distinct_and_none_is_the_warm_ups() -> None:
    cfg = LearnedBenchConfig(requests=9)
    timed = timed_workload(cfg)
    warm = {w.prompt for w in build_workload(9, seed=0, family_dir=cfg.family_dir,
                                             split="tuning")}
    prompts = [w.prompt for w in timed]
    assert len(prompts) == len(set(prompts)) == 9 and not warm & set(prompts)
    with pytest.raises(ValueError, match="ask for fewer requests"):
        timed_workload(LearnedBenchConfig(requests=10_000))


def test_the_command_checks_its_input_and_prints_the_report(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    seen: list[LearnedBenchConfig] = []

    def fake_run(cfg: LearnedBenchConfig) -> dict:
        seen.append(cfg)
        return report(cfg, {"off": [2.0], "fixed": [1.0], "auto": [1.5]},
                      {m: [(0, 0)] for m in ("off", "fixed", "auto")}, [], "t")

    monkeypatch.setattr(learned, "run_learned", fake_run)
    assert main(["bench", "learned", "--fixed", "eagle"]) == 2
    assert main(["bench", "learned", "--policy-config", '{"nope": 1}']) == 2
    assert "unknown learned-policy setting" in capsys.readouterr().err and not seen
    assert main(["bench", "learned", "--fixed", "draft-code:6", "--greedy"]) == 0
    assert seen[0].drafter == "draft-code" and seen[0].k == 6 and not seen[0].sampled
    assert "auto / draft-code:k6 0.667x" in capsys.readouterr().out
