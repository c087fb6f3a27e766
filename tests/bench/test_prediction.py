"""``spin bench prediction``'s workload, predictions and report, on made-up runs (the run itself
is a benchmark: it starts three deployments)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spin.bench.prediction import PredictionBenchConfig, _groups, _report, summary, text_of


def _dataset(tmp_path: Path, groups: int) -> Path:
    path = tmp_path / "edit.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Repeat.\n\ntext {g} v{e}", "group": g,
                                        "edit": e}) + "\n"
                            for g in range(groups) for e in range(3)))
    return path


def test_each_temperature_gets_whole_groups_of_its_own(tmp_path: Path) -> None:
    cfg = PredictionBenchConfig(dataset=_dataset(tmp_path, 5), groups=2,
                                temperatures=(0.0, 0.8))
    groups = _groups(cfg)
    assert [[(r["group"], r["edit"]) for r in g] for g in groups] == [
        [(g, e) for e in range(3)] for g in range(4)]
    with pytest.raises(ValueError, match="has 5 groups"):
        _groups(PredictionBenchConfig(dataset=_dataset(tmp_path, 5), groups=3,
                                      temperatures=(0.0, 0.8)))


def test_the_default_workload_is_code_of_the_evaluation_half() -> None:
    groups = _groups(PredictionBenchConfig(groups=2, temperatures=(0.0,)))
    rows = [r for g in groups for r in g]
    assert len(groups) == 2 and len(rows) == 6
    assert {(r["domain"], r["split"]) for r in rows} == {("code", "evaluation")}


def test_a_row_predicts_the_text_it_asks_for_without_the_instruction() -> None:
    assert text_of({"prompt": "Repeat the text below.\n\ndef f():\n\n    pass"}) == \
        "def f():\n\n    pass"
    assert text_of({"prompt": "ignored", "text": "kept"}) == "kept"


def _run(e2e: float, tokens: list[int], steps: int, pred: int = 0, rejected: int = 0) -> dict:
    return {"e2e_s": e2e, "tokens": tokens, "steps": steps, "accepted": len(tokens) - steps,
            "prediction_accepted": pred, "accepted_prediction_tokens": pred,
            "rejected_prediction_tokens": rejected}


def test_the_report_divides_what_each_mode_measured() -> None:
    out = [1, 2, 3, 4]
    per = [  # greedy: an original (no prediction), then an edit that follows its prediction
        {"temperature": 0.0, "group": 0, "edit": 0, "predicted": False,
         "prediction": _run(2.0, out, 4), "auto": _run(2.0, out, 4), "off": _run(2.0, out, 4)},
        {"temperature": 0.0, "group": 0, "edit": 1, "predicted": True,
         "prediction": _run(1.0, out, 1, 3, 2), "auto": _run(2.0, out, 2),
         "off": _run(4.0, [1, 2, 3, 5], 4)},
        {"temperature": 0.8, "group": 1, "edit": 0, "predicted": False,
         "prediction": _run(1.0, [7], 1), "auto": _run(1.0, [8], 1), "off": _run(1.0, [9], 1)}]
    r = _report(PredictionBenchConfig(groups=1), per)
    greedy, sampled = r["cells"]
    assert greedy["requests"] == 2 and greedy["predicted"] == 1
    assert greedy["tokens_per_s"] == {"prediction": 8 / 3, "auto": 2.0, "off": 8 / 6}
    assert greedy["prediction_over_off"] == pytest.approx(2.0)
    assert greedy["prediction_over_auto"] == pytest.approx(4 / 3)
    assert greedy["predicted_only"]["prediction_over_off"] == pytest.approx(4.0)
    assert greedy["median_request_speedup_over_off"] == pytest.approx(4.0)
    assert greedy["tau"]["prediction"] == pytest.approx(8 / 5)
    assert greedy["prediction_share_of_accepted"] == pytest.approx(1.0)
    assert (greedy["accepted_prediction_tokens"], greedy["rejected_prediction_tokens"]) == (3, 2)
    assert greedy["greedy_mismatches"] == 2  # the edit's output differs from off's, twice
    assert sampled["greedy_mismatches"] is None and sampled["predicted_only"] is None
    assert all("tokens" not in q[m] for q in r["requests"] for m in ("prediction", "off"))
    text = summary(r)
    assert "2.000" in text and "4.000" in text and "3/2" in text
