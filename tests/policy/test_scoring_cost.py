"""What scoring calls add to a step: recursive least squares on served steps."""

from __future__ import annotations

import random

import pytest

from spin.policy.scoring_cost import ScoringCost


def test_nothing_is_predicted_before_a_step_was_seen_or_without_calls() -> None:
    cost = ScoringCost()
    assert cost.predict(4, 600) == 0.0
    cost.observe(0, 0, 0.5)  # no scoring calls: nothing to learn
    assert cost.steps == 0
    cost.observe(2, 100, 0.010)
    assert cost.predict(2, 100) > 0.0 and cost.predict(0, 0) == 0.0


def test_it_recovers_a_per_call_and_a_per_token_cost_from_noisy_steps() -> None:
    rng = random.Random(0)
    cost = ScoringCost()
    for _ in range(200):  # 2 ms per call + 8 ms per 100 tokens, +-10% noise
        calls = rng.choice([1, 2, 4])
        tokens = calls * rng.choice([12, 150, 300])
        cost.observe(calls, tokens, (0.002 * calls + 0.08 * tokens / 1000) * rng.uniform(0.9, 1.1))
    a, b = cost.coefficients
    assert a == pytest.approx(0.002, rel=0.3) and b == pytest.approx(0.008, rel=0.1)
    assert cost.predict(4, 1200) == pytest.approx(0.008 + 0.096, rel=0.1)
    assert cost.predict(1, 12) == pytest.approx(0.002 + 0.00096, rel=0.3)


def test_it_follows_a_change_of_machine_load() -> None:
    cost = ScoringCost(forget=0.9)
    for _ in range(50):
        cost.observe(1, 12, 0.004)
    for _ in range(50):  # the machine got busier: twice as slow
        cost.observe(1, 12, 0.008)
    assert cost.predict(1, 12) == pytest.approx(0.008, rel=0.05)
    with pytest.raises(ValueError, match="forget"):
        ScoringCost(forget=0.0)
