"""Repetition measures: hand-computed loop masks and shares, and the report's repetition table."""

from pathlib import Path

import pytest

from spin.zoo.repetition import (compare_with_human, distinct_share, loop_mask, loop_share,
                                 repetition_stats)
from spin.zoo.report import ReportConfig, markdown, run_report
from spin.zoo.specs import DOMAINS


def test_period_one_loop() -> None:
    # 7 then six 5s: the first 5 is the unit, the five copies after it are in the loop.
    assert loop_mask([7, 5, 5, 5, 5, 5, 5]) == [False, False, True, True, True, True, True]
    assert loop_share([7, 5, 5, 5, 5, 5, 5]) == pytest.approx(5 / 7)
    assert distinct_share([7, 5, 5, 5, 5, 5, 5]) == pytest.approx(2 / 7)


def test_period_three_loop() -> None:
    seq = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    assert loop_mask(seq) == [False] * 3 + [True] * 6
    assert loop_share(seq) == pytest.approx(6 / 9)
    assert distinct_share(seq) == pytest.approx(3 / 9)


def test_no_loop() -> None:
    assert loop_share([1, 2, 3, 4]) == 0.0
    assert distinct_share([1, 2, 3, 4]) == 1.0
    # A doubled or tripled token spans fewer than 4 tokens: no loop.
    assert loop_share([1, 2, 2, 3]) == 0.0
    assert loop_share([9, 4, 4, 4, 8]) == 0.0


def test_loop_starting_mid_sequence() -> None:
    seq = [7, 8, 9, 1, 2, 1, 2, 1, 2]  # new text, then (1 2) three times
    assert loop_mask(seq) == [False] * 5 + [True] * 4
    assert loop_share(seq) == pytest.approx(4 / 9)
    # A loop that ends and new text after it: only the copies count.
    assert loop_mask([4, 6, 4, 6, 3, 1]) == [False, False, True, True, False, False]


def test_near_loop_with_one_token_different() -> None:
    assert loop_share([1, 2, 3, 1, 2, 4]) == 0.0
    assert loop_share([1, 2, 3, 1, 2, 4, 1, 2, 3]) == 0.0
    # One token off in the middle splits a loop in two: (1 2) x3, then 9, then (2 1) x2 + 2, whose
    # first unit (2 1) is no copy.
    seq = [1, 2, 1, 2, 1, 2, 9, 2, 1, 2, 1, 2]
    assert loop_mask(seq) == [False, False, True, True, True, True, False, False, False,
                              True, True, True]


def test_period_limit() -> None:
    unit = list(range(40))
    assert loop_share(unit + unit) == 0.0  # period 40 > 32
    assert loop_share(unit + unit, max_period=40) == pytest.approx(0.5)


def test_stats_average_per_request_and_cut_to_the_shorter() -> None:
    stats = repetition_stats([[1, 2, 3, 4], [5, 5, 5, 5], []])
    assert stats == {"distinct_share": 0.625, "loop_share": 0.375, "requests": 2, "tokens": 8}
    rep = compare_with_human({"code": [[5, 5, 5, 5, 5, 5]]}, {"code": [[1, 2, 3, 4]]})
    # Both cut to 4 tokens: target 3 of 4 in a loop, 1 distinct id of 4; human none, 4 of 4.
    assert rep["target"]["code"] == {"distinct_share": 0.25, "loop_share": 0.75, "requests": 1,
                                     "tokens": 4}
    assert rep["human"]["code"]["loop_share"] == 0.0 and rep["human"]["code"]["distinct_share"] == 1
    assert rep["target"]["overall"] == rep["target"]["code"]


def test_report_measures_repetition(family_dir: Path) -> None:
    report = run_report(ReportConfig(family_dir=family_dir, prompts_per_domain=1, new_tokens=16,
                                     timing_runs=1))
    rep = report["repetition"]
    for side in ("target", "human"):
        assert set(rep[side]) == {*DOMAINS, "overall"}
        for row in rep[side].values():
            assert 0.0 < row["distinct_share"] <= 1.0 and 0.0 <= row["loop_share"] < 1.0
        assert rep[side]["overall"]["requests"] == len(DOMAINS)
        assert 0 < rep[side]["overall"]["tokens"] <= 16 * len(DOMAINS)
    assert rep["target"]["overall"]["tokens"] == rep["human"]["overall"]["tokens"]
    assert "| overall |" in markdown(report)
