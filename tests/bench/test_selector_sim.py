"""The selector simulation: a workload whose classes want different drafters, and the bandit's
measured regret on it."""

from __future__ import annotations

import pytest

from spin.bench.selector_sim import (SimArm, compare_algorithms, mixture_population,
                                     regret_table, simulate_regret, three_class_workload)
from spin.policy.selector import ALGORITHMS, SelectorConfig

WORKLOAD = three_class_workload()
DEFAULT = SelectorConfig().algorithm


def _arms(request_class: str) -> dict[str, SimArm]:
    return {a.name: a for a in WORKLOAD if a.request_class == request_class}


def test_workload_has_a_different_best_arm_per_class() -> None:
    best = {c: max(_arms(c).values(), key=lambda a: a.expected_goodput()).name
            for c in ("code", "prose", "structured")}
    assert best == {"code": "sim-code", "prose": "sim-prose", "structured": "sim-structured"}
    mix = mixture_population(WORKLOAD)
    assert max(mix, key=lambda n: mix[n].mean_reward) != "sim-prose"  # wrong for prose requests


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_simulated_regret_is_deterministic_with_a_seed(algorithm: str) -> None:
    assert simulate_regret(algorithm, WORKLOAD, 16, 30, seed=4) == simulate_regret(
        algorithm, WORKLOAD, 16, 30, seed=4)


def test_regret_default_is_low_and_beats_epsilon_greedy() -> None:
    regret = compare_algorithms(WORKLOAD, steps=32, requests=300, seed=0)
    assert set(regret) == set(ALGORITHMS)
    assert regret[DEFAULT] <= 0.15
    assert regret["thompson"] <= 0.15
    assert regret[DEFAULT] < regret["greedy"] and regret["thompson"] < regret["greedy"]
    assert all(0.0 <= r < 0.5 for r in regret.values())


def test_regret_with_a_correct_prior_is_small_and_table_prints() -> None:
    assert simulate_regret(DEFAULT, WORKLOAD, 32, 60, seed=0, prior="class") < 0.05
    table = regret_table(WORKLOAD, steps=(8, 16), requests=15, seed=0).splitlines()
    assert table[0].split() == ["algorithm", "8", "steps", "16", "steps"]
    assert [line.split()[0] for line in table[1:]] == list(ALGORITHMS)
