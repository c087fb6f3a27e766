"""DraftSelector: the per-request bandit over drafters and its warm start, on the simulated
workload of ``spin.bench.selector_sim`` (its regret: ``tests/bench/test_selector_sim.py``)."""

from __future__ import annotations

import random

import pytest

from spin.bench.selector_sim import (SimArm, class_population, mixture_population,
                                    three_class_workload)
from spin.policy.base import PROMPT_LOOKUP
from spin.policy.population import PopulationArm, population_from_stats
from spin.policy.selector import ALGORITHMS, DraftSelector, SelectorConfig
from spin.stats.store import DrafterStats

WORKLOAD = three_class_workload()
DRAFTERS = {"sim-code", "sim-prose", "sim-structured", PROMPT_LOOKUP}


def _arms(request_class: str) -> dict[str, SimArm]:
    return {a.name: a for a in WORKLOAD if a.request_class == request_class}


def _step(sel: DraftSelector, rid: str, arms: dict[str, SimArm], rng: random.Random,
          available: set[str] | None = None) -> str:
    """One simulated step of request ``rid``, as the router would run it."""
    name = sel.choose(rid, available or set(arms))
    seconds = arms[name].step_seconds(sel.switch_cost_s(rid, name))
    sel.update(rid, name, arms[name].sample_tokens(rng), seconds)
    return name


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_only_available_drafters_are_chosen(algorithm: str) -> None:
    sel = DraftSelector(SelectorConfig(algorithm=algorithm, seed=3), mixture_population(WORKLOAD))
    rng, arms = random.Random(0), _arms("code")
    for i in range(200):
        available = {PROMPT_LOOKUP} | {n for n in DRAFTERS if rng.random() < 0.5}
        assert _step(sel, f"r{i % 5}", arms, rng, available) in available
    assert sel.choose("r", {PROMPT_LOOKUP}) == PROMPT_LOOKUP
    with pytest.raises(ValueError):
        sel.choose("r", set())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_unavailable_drafter_is_never_returned(algorithm: str) -> None:
    cfg = SelectorConfig(algorithm=algorithm, seed=1)
    sel = DraftSelector(cfg, class_population(WORKLOAD, "code"))
    rng, arms = random.Random(1), _arms("code")
    for _ in range(10):
        _step(sel, "r", arms, rng)
    assert max(sel.snapshot("r").items(), key=lambda kv: kv[1][0])[0] == "sim-code"
    down = DRAFTERS - {"sim-code"}
    assert all(_step(sel, "r", arms, rng, down) != "sim-code" for _ in range(50))
    assert "sim-code" in {_step(sel, "r", arms, rng) for _ in range(20)}  # back: chosen again


def test_release_frees_state() -> None:
    sel = DraftSelector(population=mixture_population(WORKLOAD))
    rng, arms = random.Random(2), _arms("prose")
    for rid in ("a", "b"):
        for _ in range(5):
            _step(sel, rid, arms, rng)
    assert len(sel._requests) == 2
    sel.release("a")
    sel.release("a")  # idempotent
    sel.release("never-seen")
    assert len(sel._requests) == 1 and sel.snapshot("a") == {}
    assert sum(n for _, n in sel.snapshot("b").values()) == 5
    sel.choose("a", DRAFTERS)  # a reused id starts from the population again
    assert all(n == 0 for _, n in sel.snapshot("a").values())
    assert sel.switch_cost_s("a", "sim-code") == SelectorConfig().switch_cost_s


@pytest.mark.parametrize("algorithm", ["ucb", "thompson"])
def test_request_learns_away_from_a_wrong_prior_within_8_steps(algorithm: str) -> None:
    """Prose requests under the mixture prior, which favours sim-code and sim-structured.

    Measured on 400 requests: after 8 steps ~96% (ucb) / ~90% (thompson) have tried sim-prose and
    ~70% rank it first; in steps 9-16 it is chosen ~79% / ~73% of the time. One step's goodput is
    noisy (1..5 tokens), so an unlucky first sim-prose step can hide it for a while.
    """
    sel = DraftSelector(SelectorConfig(algorithm=algorithm, seed=5), mixture_population(WORKLOAD))
    rng, arms, n = random.Random(5), _arms("prose"), 60
    first, tried, ranked, later = [], 0, 0, []
    for i in range(n):
        rid = f"prose-{i}"
        first.append(sel.choose(rid, DRAFTERS))
        tried += "sim-prose" in {_step(sel, rid, arms, rng) for _ in range(8)}
        snap = sel.snapshot(rid)
        ranked += max(snap, key=lambda name: snap[name][0]) == "sim-prose"
        later += [_step(sel, rid, arms, rng) for _ in range(8)]
        sel.release(rid)
    assert first.count("sim-prose") <= n // 5  # the prior really is wrong for this class
    assert tried >= 0.8 * n
    assert ranked >= 0.55 * n
    assert later.count("sim-prose") >= 0.6 * len(later)


@pytest.mark.parametrize("algorithm", ["ucb", "thompson"])
@pytest.mark.parametrize("request_class", ["code", "prose", "structured"])
def test_correct_prior_first_choice_is_the_best_arm(algorithm: str, request_class: str) -> None:
    best = max(_arms(request_class).values(), key=lambda a: a.expected_goodput()).name
    for seed in range(20):
        sel = DraftSelector(SelectorConfig(algorithm=algorithm, seed=seed),
                            class_population(WORKLOAD, request_class))
        assert sel.choose(f"r{seed}", DRAFTERS) == best


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_deterministic_with_a_seed(algorithm: str) -> None:
    def run(seed: int) -> list[str]:
        cfg = SelectorConfig(algorithm=algorithm, seed=seed)
        sel = DraftSelector(cfg, mixture_population(WORKLOAD))
        rng, out = random.Random(9), []
        for i in range(12):
            arms = _arms(("code", "prose", "structured")[i % 3])
            out += [_step(sel, f"r{i}", arms, rng) for _ in range(10)]
        return out

    assert run(7) == run(7)


def test_switch_cost() -> None:
    sel = DraftSelector(SelectorConfig(switch_cost_s=0.005))
    assert sel.switch_cost_s("r", "sim-code") == 0.005  # a new request's first drafter catches up
    sel.update("r", "sim-code", 3, 0.03)
    assert sel.switch_cost_s("r", "sim-code") == 0.0
    assert sel.switch_cost_s("r", "sim-prose") == 0.005
    assert sel.switch_cost_s("r", PROMPT_LOOKUP) == 0.0  # model-free: no KV cache to catch up
    sel.update("r", "sim-prose", 2, 0.03)
    assert sel.switch_cost_s("r", "sim-code") == 0.005  # switching back catches up again
    assert DraftSelector().switch_cost_s("x", "sim-code") == 0.002  # the default
    strict = DraftSelector(SelectorConfig(switch_free=frozenset()))
    assert strict.switch_cost_s("x", PROMPT_LOOKUP) == 0.002


def test_population_from_stats_math() -> None:
    stats = {
        # 10 steps emitting 10 bonus + 25 accepted tokens in 0.08 + 0.20 s -> 35 / 0.28 = 125 tok/s
        "sim-code": DrafterStats(drafts=10, draft_tokens=40, accepted_tokens=25,
                                   draft_seconds=0.08, verify_seconds=0.20),
        # no time recorded: 4 steps, 4 + 6 tokens; with a 0.025 s/step hint -> 10 / 0.1 = 100 tok/s
        "sim-prose": DrafterStats(drafts=4, draft_tokens=16, accepted_tokens=6),
        "unused": DrafterStats(),
    }
    pop = population_from_stats(stats)
    assert set(pop) == {"sim-code"}
    assert pop["sim-code"].mean_reward == pytest.approx(125.0)
    assert pop["sim-code"].observations == 10
    hinted = population_from_stats(stats, step_s_hint=0.025)
    assert hinted["sim-prose"] == PopulationArm(pytest.approx(100.0), 4)
    assert hinted["sim-code"].mean_reward == pytest.approx(125.0)  # real time wins over the hint


def test_prior_weight_is_capped_and_posterior_mean_moves() -> None:
    pop = {"sim-code": PopulationArm(100.0, 10_000), "sim-prose": PopulationArm(50.0, 1)}
    sel = DraftSelector(SelectorConfig(prior_strength=3), pop)
    sel.choose("r", {"sim-code", "sim-prose"})
    assert sel.snapshot("r") == {"sim-code": (pytest.approx(100.0), 0), "sim-prose": (50.0, 0)}
    for _ in range(3):
        sel.update("r", "sim-code", 2, 0.1)  # 20 tok/s, three times against a prior worth 3
    sel.update("r", "sim-prose", 1, 0.01)  # 100 tok/s against a prior worth 1 observation
    snap = sel.snapshot("r")
    assert snap["sim-code"] == (pytest.approx(60.0), 3)
    assert snap["sim-prose"] == (pytest.approx(75.0), 1)
    assert sel.choose("r", {"sim-code", "sim-prose"}) == "sim-prose"


def test_a_sampling_request_starts_from_the_sampled_population_entries() -> None:
    pop = {"sim-code": PopulationArm(100.0, 500), "sim-code@sampled": PopulationArm(30.0, 500),
           "sim-prose": PopulationArm(60.0, 500)}
    sel = DraftSelector(SelectorConfig(), pop)
    sel.begin("s", greedy=False)
    sel.begin("g", greedy=True)
    both = {"sim-code", "sim-prose"}
    assert sel.choose("s", both) == "sim-prose"  # sampled, sim-code is worse than sim-prose
    assert sel.choose("g", both) == "sim-code"
    assert sel.snapshot("s") == {"sim-code": (pytest.approx(30.0), 0),
                                 "sim-prose": (pytest.approx(60.0), 0)}  # greedy stands in
    sel.begin("g", greedy=False)  # a known request keeps its state
    assert sel.snapshot("g")["sim-code"] == (pytest.approx(100.0), 0)


def test_discount_forgets_the_prior_faster() -> None:
    pop = {"sim-code": PopulationArm(100.0, 1000)}
    means = []
    for discount in (1.0, 0.8):
        sel = DraftSelector(SelectorConfig(discount=discount), pop)
        for _ in range(5):
            sel.update("r", "sim-code", 2, 0.1)
        means.append(sel.snapshot("r")["sim-code"][0])
    assert 20.0 < means[1] < means[0] < 100.0
    with pytest.raises(ValueError):
        DraftSelector(SelectorConfig(discount=0.0))


def test_drafters_without_population_data_are_tried() -> None:
    sel = DraftSelector(population={"sim-code": PopulationArm(100.0, 500)})
    assert sel.choose("r", {"sim-code", "draft-new"}) == "draft-new"  # optimistic prior
    blank = DraftSelector(SelectorConfig(seed=2))  # no population at all: each tried once first
    rng, arms = random.Random(3), _arms("code")
    assert {_step(blank, "r", arms, rng) for _ in range(4)} == DRAFTERS


def test_bad_steps_are_ignored() -> None:
    sel = DraftSelector(population=mixture_population(WORKLOAD))
    sel.choose("r", DRAFTERS)
    before = sel.snapshot("r")
    sel.update("r", "sim-code", 3, 0.0)
    sel.update("r", "sim-code", 3, float("nan"))
    assert sel.snapshot("r") == before


def test_set_prior_replaces_the_prior_and_keeps_own_observations() -> None:
    sel = DraftSelector(SelectorConfig(), {"a": PopulationArm(100.0, 50), "b": PopulationArm(50.0, 50)})
    sel.update("r", "b", 1, 0.1)  # one own step of b: 10 tokens/s
    sel.set_prior("r", "b", 300.0, 4.0)  # b predicted at 300 tokens/s, worth 4 steps
    mean, n = sel.snapshot("r")["b"]
    assert n == 1 and mean == pytest.approx((300.0 * 4 + 10.0) / 5)
    sel.set_prior("r", "a", 30.0, 4.0)  # never used: the prediction is its whole posterior
    assert sel.snapshot("r")["a"] == (pytest.approx(30.0), 0)
    assert sel.choose("r", {"a", "b"}) == "b"
