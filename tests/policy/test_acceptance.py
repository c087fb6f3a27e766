"""The acceptance tracker: a discounted truncated-geometric estimate per request and drafter."""

from __future__ import annotations

import numpy as np
import pytest

from spin.policy.acceptance import AcceptanceTracker
from spin.policy.dispersion import MIN_REQUESTS
from spin.policy.goodput import ControllerConfig


def _geometric_steps(rng: np.random.Generator, a: float, k: int, n: int) -> list[int]:
    """Accepted tokens of ``n`` chain steps: successes before the first failure, capped at k."""
    return [min(int(rng.geometric(1 - a)) - 1, k) for _ in range(n)]


@pytest.mark.parametrize("a", [0.2, 0.5, 0.7, 0.9])
def test_estimator_converges_to_true_acceptance(a: float) -> None:
    rng = np.random.default_rng(int(a * 100))
    t = AcceptanceTracker(ControllerConfig(ema=0.02))
    t.set_population({"d": 0.5})
    for acc in _geometric_steps(rng, a, 4, 200):
        t.update("r", "d", 4, acc)
    assert t.get("r", "d") == pytest.approx(a, abs=0.05)
    assert t.observations("r", "d") == 200


def test_estimator_is_unbiased_under_censoring_with_default_ema() -> None:
    # k = 2 censors most runs at a = 0.8; the estimate still centres on a (a naive EMA of
    # accepted/k would centre on E[min(G, 2)]/2 = 0.72, and of accepted/(accepted+1) lower still).
    rng = np.random.default_rng(7)
    t = AcceptanceTracker(ControllerConfig())
    est = []
    for acc in _geometric_steps(rng, 0.8, 2, 3000):
        t.update("r", "d", 2, acc)
        est.append(t.get("r", "d"))
    assert np.mean(est[100:]) == pytest.approx(0.8, abs=0.03)


def test_tracker_seed_prior_min_observations_and_release() -> None:
    t = AcceptanceTracker(ControllerConfig(prior_acceptance=0.4, min_observations=2))
    assert t.get("r", "d") == 0.4
    t.set_population({"d": 0.9, "e": 1.5})
    assert t.get("r", "d") == 0.9 and t.get("r", "e") == 1.0 and t.get("r", "x") == 0.4
    t.update("r", "d", 4, 0)
    assert t.get("r", "d") == 0.9  # one observation < min_observations
    t.update("r", "d", 4, 0)
    assert t.get("r", "d") < 0.9
    t.update("r", "d", 0, 0)  # k = 0: no information
    assert t.observations("r", "d") == 2
    assert t.get("other", "d") == 0.9
    t.release("r")
    assert t.get("r", "d") == 0.9 and t.observations("r", "d") == 0
    t.release("never-seen")
    with pytest.raises(ValueError):
        t.update("r", "d", 3, 4)


def test_sampling_requests_are_seeded_from_the_sampled_population_entry() -> None:
    t = AcceptanceTracker(ControllerConfig(prior_acceptance=0.4))
    t.set_population({"d": 0.8, "d@sampled": 0.5, "e": 0.7})
    t.begin("s", greedy=False)
    t.begin("g", greedy=True)
    assert t.get("s", "d") == 0.5 and t.get("g", "d") == 0.8 and t.get("never-opened", "d") == 0.8
    assert t.get("s", "e") == 0.7  # no sampled entry yet: the greedy one stands in
    assert t.prior("d", "s") == 0.5 and t.prior("x", "s") == 0.4
    t.update("s", "d", 4, 0)  # its counts start at the sampled rate
    t.update("s", "d", 4, 0)
    assert t.get("s", "d") < 0.5
    t.release("s")
    assert t.get("s", "d") == 0.8  # forgotten: a new request of that id counts as greedy


def test_tracker_all_accepted_moves_towards_one() -> None:
    t = AcceptanceTracker(ControllerConfig())
    t.set_population({"d": 0.5})
    for _ in range(30):
        t.update("r", "d", 4, 4)
    assert t.get("r", "d") > 0.98


def test_agreement_evidence_moves_the_estimate_like_draft_tokens() -> None:
    tr = AcceptanceTracker(ControllerConfig(prior_trials=2.0), population={"d": 0.5})
    tr.add_evidence("r", "d", 18, 2)  # 18 of 20 positions agreed
    assert tr.get("r", "d") == pytest.approx((1 + 18) / (2 + 20))
    tr.add_evidence("r", "e", 0, 10)  # unknown drafter: the default prior, then the evidence
    assert tr.get("r", "e") < 0.1


def test_a_tracker_without_settings_takes_the_controllers_defaults() -> None:
    t = AcceptanceTracker()
    assert t.cfg == ControllerConfig()
    assert t.get("r", "d") == ControllerConfig().prior_acceptance


def test_a_held_requests_estimate_ages_back_to_the_population_rate() -> None:
    """Two bad steps pull a greedy request's estimate below the population's; each step held
    at k = 0 then moves it back as a step of ``prior_trials`` trials at that rate would, so the
    controller tries the drafter again; a drafter the request never used is left alone."""
    t = AcceptanceTracker(ControllerConfig(ema=0.3, prior_trials=2.0))
    t.set_population({"eagle": 0.7})
    t.begin("r", greedy=True)
    t.update("r", "eagle", 4, 2)
    t.update("r", "eagle", 4, 0)
    low = t.get("r", "eagle")
    assert low == pytest.approx(0.58, abs=0.01)
    seen = [low]
    for _ in range(12):
        t.relax("r", "eagle")
        seen.append(t.get("r", "eagle"))
    assert all(a < b for a, b in zip(seen, seen[1:])) and seen[-1] == pytest.approx(0.7, abs=0.01)
    t.relax("r", "draft-code")  # never drafted for it: nothing to age
    assert t.get("r", "draft-code") == t.prior("draft-code", "r")
    u = AcceptanceTracker(ControllerConfig(ema=0.3, prior_trials=2.0))  # a held call of 5
    u.set_population({"eagle": 0.7})  # forwards ages as 5 held steps do, in one go
    u.begin("r", greedy=True)
    u.update("r", "eagle", 4, 2)
    u.update("r", "eagle", 4, 0)
    u.relax("r", "eagle", 5)
    assert u.get("r", "eagle") == pytest.approx(seen[5], rel=1e-9)


def test_a_sampling_requests_steps_count_alike_and_its_prior_is_never_spent() -> None:
    """A sampling request's estimate is (S + m a0) / (S + F + m): every step's accepted tokens
    and rejection count alike, and the population's rate keeps its ``m`` trials however many
    steps come (``prior_trials`` until the dispersion is measured); a step held at k = 0 moves
    nothing; predicted evidence (a fit's seed, scores) is discounted as the steps come."""
    t = AcceptanceTracker(ControllerConfig(prior_trials=2.0))
    t.set_population({"eagle@sampled": 0.7})
    t.begin("r", greedy=False)
    steps = [(4, 4), (4, 0), (4, 2), (3, 3), (4, 1)]
    for k, acc in steps:
        t.update("r", "eagle", k, acc)
    s, f = 10.0, 3.0
    assert t.get("r", "eagle") == pytest.approx((s + 2 * 0.7) / (s + f + 2))
    t.relax("r", "eagle")
    assert t.get("r", "eagle") == pytest.approx((s + 2 * 0.7) / (s + f + 2))
    t.add_evidence("r", "eagle", 4, 4)  # a prediction: it weighs less with each step
    assert t.get("r", "eagle") == pytest.approx((s + 4 + 2 * 0.7) / (s + f + 8 + 2))
    t.update("r", "eagle", 4, 4)
    w = 1 - t.cfg.ema
    assert t.get("r", "eagle") == pytest.approx((s + 4 + 4 * w + 2 * 0.7)
                                                 / (s + 4 + f + 8 * w + 2))


def test_the_prior_strength_is_measured_from_how_much_released_requests_differ() -> None:
    """Released sampling requests record their own counts per drafter; from ``MIN_REQUESTS``
    of them the prior's strength is the method of moments' m = a (1 - a) / v - 1: requests
    alike (rates within their sampling noise) make the population rate weigh the most, requests
    far apart make each request's own steps decide."""
    rng = np.random.default_rng(3)

    def tracker_after(rates: list[float]) -> AcceptanceTracker:
        t = AcceptanceTracker(ControllerConfig(prior_trials=2.0))
        t.set_population({"d@sampled": 0.7})
        for i, a in enumerate(rates):
            t.begin(f"r{i}", greedy=False)
            for acc in _geometric_steps(rng, a, 4, 25):
                t.update(f"r{i}", "d", 4, acc)
            t.release(f"r{i}")
        return t

    few = tracker_after([0.7] * (MIN_REQUESTS - 1))
    assert few.strength("d") == 2.0  # not measured yet: prior_trials
    alike = tracker_after([0.7] * 24).strength("d")
    apart = tracker_after([0.2, 0.95] * 12).strength("d")
    assert alike > 50 and apart < 3
    t = tracker_after([0.7] * 24)
    t.begin("x", greedy=False)
    t.update("x", "d", 4, 0)
    assert t.get("x", "d") > 0.68  # one bad step against a prior of requests alike
    assert AcceptanceTracker().strength("d") == ControllerConfig().prior_trials
    greedy = AcceptanceTracker()
    greedy.update("g", "d", 4, 2)
    greedy.release("g")
    assert all(greedy.dispersion.strength(e) is None for e in ("d", "d@sampled"))
