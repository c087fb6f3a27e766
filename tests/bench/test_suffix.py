"""``spin bench suffix``'s workload slices and report, on made-up runs (the run itself is a
benchmark: it starts two deployments)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spin.bench.suffix import SuffixBenchConfig, _report, _rows, summary


def _dataset(tmp_path: Path, groups: int) -> Path:
    path = tmp_path / "edit.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"text {g} v{e}", "group": g, "edit": e}) + "\n"
                            for g in range(groups) for e in range(3)))
    return path


def test_each_pass_gets_whole_groups_of_its_own(tmp_path: Path) -> None:
    rows = _rows(SuffixBenchConfig(dataset=_dataset(tmp_path, 5), groups=2, rounds=2))
    assert [(r["group"], r["edit"]) for r in rows] == [(g, e) for g in range(4) for e in range(3)]
    with pytest.raises(ValueError, match="has 5 groups"):
        _rows(SuffixBenchConfig(dataset=_dataset(tmp_path, 5), groups=3, rounds=2))


def _run(e2e: float, tokens: list[int], steps: int, suffix: int = 0) -> dict:
    return {"e2e_s": e2e, "tokens": tokens, "steps": steps, "accepted": len(tokens) - steps,
            "suffix_accepted": suffix}


def test_the_report_divides_what_each_mode_measured() -> None:
    out = [1, 2, 3, 4]
    per = [{"group": 0, "edit": 0, "pass": 0, "with": _run(1.0, out, 2, 1),
            "without": _run(2.0, out, 4), "off": _run(2.0, out, 4)},
           {"group": 0, "edit": 1, "pass": 0, "with": _run(0.5, out, 1, 3),
            "without": _run(2.0, out, 4), "off": _run(2.0, out, 4)},
           {"group": 1, "edit": 0, "pass": 1, "with": _run(2.0, [9, 9, 9, 9], 4),
            "without": _run(2.0, out, 4), "off": _run(2.0, out, 4)}]
    r = _report(SuffixBenchConfig(groups=1, rounds=2), per)
    assert r["tokens_per_s"] == {"with": 12 / 3.5, "without": 2.0, "off": 2.0}
    assert r["with_over_without"] == pytest.approx(12 / 3.5 / 2.0)
    assert r["with_over_without_by_pass"] == pytest.approx([(8 / 1.5) / 2.0, 1.0])
    assert r["with_over_without_edits"] == pytest.approx(4.0)
    assert r["median_request_ratio"] == 2.0
    assert r["greedy_mismatches"] == 1  # the third request's "with" output differs from off's
    assert r["suffix_share_of_accepted"] == pytest.approx(4 / 5)
    assert "tokens" not in r["requests"][0]["with"]
    assert "greedy outputs that differ from off: 1" in summary(r)


def test_the_shared_run_says_what_it_compared_and_how_long_texts_took() -> None:
    out = [1, 2, 3, 4]
    per = [{"group": 0, "edit": e, "pass": 0, "with": _run(1.0, out, 2, 2),
            "without": _run(2.0, out, 4), "off": _run(2.0, out, 4)} for e in (0, 1)]
    r = _report(SuffixBenchConfig(groups=1, rounds=1, share=True), per)
    r["share_wait_s"] = {"median": 0.125, "max": 0.25}
    text = summary(r)
    assert r["config"]["share"] is True
    assert text.startswith("tokens/s: two routers sharing suffix decoding's texts 4.0, "
                           "without 2.0")
    assert "reached the second router 0.125 s after its end (median; at most 0.250 s)" in text
