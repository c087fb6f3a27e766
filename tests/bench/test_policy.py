"""The policy benchmark's accounting: the oracle and the best fixed configuration, chosen on some
passes and timed on another."""

from __future__ import annotations

import pytest

from spin.bench.policy import _best_fixed, _held_out, _medians, _oracle

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
