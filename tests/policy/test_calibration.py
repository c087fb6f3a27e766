"""Online calibration of the cost model (``policy/calibration.py``): which steps move which
factor, how far, and what they leave alone."""

from __future__ import annotations

import math

import pytest

from spin.policy.calibration import FACTOR_CLIP, FORGET_SHARE, RATIO_CLIP, Calibration


def test_plain_steps_move_the_plain_factor_and_speculating_ones_the_marginal() -> None:
    cal = Calibration(rate=0.5)
    cal.observe(0.010, 0.010, 0.012, {}, {})  # a plain step measured 1.2x
    assert (cal.plain, cal.marginal) == (pytest.approx(1.1), 1.0)
    # speculating: predicted 0.011 plain + 0.004 more; measured 0.011 + 0.012 (3x the added part)
    cal.observe(0.011, 0.015, 0.023, {"d": 0.002}, {"d": 0.004})
    assert cal.plain == pytest.approx(1.1) and cal.marginal == pytest.approx(2.0)
    assert cal.draft("d") == pytest.approx(1.5) and cal.draft("other") == 1.0
    assert cal.verify(0.010, 0.014) == pytest.approx(1.1 * 0.010 + 2.0 * 0.004)


def test_a_factor_holds_over_a_few_steps_without_its_part_then_drifts_back_to_one() -> None:
    cal = Calibration(rate=0.2)
    for _ in range(40):  # speculation's added verification measured at 4x, the drafter at 3x;
        # each step predicted with the factors so far, as the controller does
        cal.observe(cal.verify(0.010, 0.010), cal.verify(0.010, 0.014), 0.010 + 4 * 0.004,
                    {"d": 0.002 * cal.draft("d")}, {"d": 0.006})
    marginal, draft = cal.marginal, cal.draft("d")
    assert marginal == pytest.approx(4.0, rel=0.01) and draft == pytest.approx(3.0, rel=0.01)
    for _ in range(5):  # up to 1 / rate plain steps: nothing drafted, nothing forgotten
        cal.observe(0.010, 0.010, 0.010, {}, {})
    assert (cal.marginal, cal.draft("d")) == (marginal, draft)
    for _ in range(int(0.693 / (0.2 * FORGET_SHARE)) + 1):  # then half-way back (in logs)
        cal.observe(0.010, 0.010, 0.010, {}, {})
    assert math.log(cal.marginal) == pytest.approx(math.log(marginal) / 2, rel=0.05)
    assert math.log(cal.draft("d")) == pytest.approx(math.log(draft) / 2, rel=0.05)
    assert cal.plain == 1.0  # plain steps measured as predicted


def test_a_verification_beside_prefills_or_scoring_calibrates_only_the_drafters() -> None:
    cal = Calibration(rate=0.5)
    cal.observe(0.010, 0.014, 0.500, {"d": 0.002}, {"d": 0.004}, verification=False)
    assert (cal.plain, cal.marginal, cal.draft("d")) == (1.0, 1.0, pytest.approx(1.5))


def test_outliers_move_a_factor_by_a_bounded_step_and_factors_stay_bounded() -> None:
    cal = Calibration(rate=0.1)
    cal.observe(0.010, 0.010, 10.0, {}, {})  # a 1000x stall (a collection, a neighbour)
    assert cal.plain == pytest.approx(1 + 0.1 * (RATIO_CLIP - 1))
    for _ in range(500):
        cal.observe(0.010, 0.010, 10.0, {"d": 1e-3}, {"d": 1e-9})
    assert cal.plain == FACTOR_CLIP and cal.draft("d") == 1 / FACTOR_CLIP


def test_what_cannot_be_a_measurement_is_ignored_and_rate_zero_is_off() -> None:
    cal = Calibration(rate=0.5)
    cal.observe(0.010, 0.014, 0.008, {"d": 0.002}, {"d": 0.0})  # faster than plain; d failed
    assert (cal.plain, cal.marginal, cal.draft("d")) == (1.0, 1.0, 1.0)
    cal.observe(0.0, 0.0, 0.010, {}, {})  # no prediction
    assert cal.plain == 1.0
    off = Calibration(rate=0.0)
    off.observe(0.010, 0.010, 0.020, {"d": 0.002}, {"d": 0.004})
    assert (off.plain, off.marginal, off.drafter) == (1.0, 1.0, {})
    cal.observe(0.010, 0.010, 0.020, {}, {})
    cal.reset()
    assert (cal.plain, cal.marginal, cal.drafter) == (1.0, 1.0, {})


def test_factors_name_each_part_for_the_metrics() -> None:
    cal = Calibration(rate=0.5)
    assert cal.factors() == {("verify_plain", ""): 1.0, ("verify_speculating", ""): 1.0}
    cal.observe(0.1, 0.1, 0.2, {"d": 0.01}, {"d": 0.03})  # a plain step 2x, the drafter 3x
    assert cal.factors() == {("verify_plain", ""): pytest.approx(1.5),
                             ("verify_speculating", ""): 1.0, ("draft", "d"): pytest.approx(2.0)}
