"""``spin bench fit``: the signals' hits and the best-fit acceptance, on made-up and real data."""

from __future__ import annotations

from pathlib import Path

import pytest

from spin.bench.fit import FitBenchConfig, run_fit_bench, summarize
from spin.timing.cost_model import CostModel
from spin.policy.learned_config import LearnedPolicyConfig


def _rec(**drafters: tuple[float, float, float]) -> dict:
    """(output, prompt, early output) agreement per drafter, over 64 output tokens."""
    d = {n: {"output": o, "prompt": p, "early_output": e} for n, (o, p, e) in drafters.items()}
    return {"domain": "x", "output_tokens": 64, "drafters": d}


def test_summary_counts_hits_losses_and_best_fit_acceptance() -> None:
    # (output, prompt, early output) agreement per drafter
    recs = [_rec(a=(0.9, 0.5, 0.2), b=(0.4, 0.1, 0.6)),  # prompt right, early output wrong
            _rec(a=(0.3, 0.2, 0.8), b=(0.8, 0.4, 0.1))]  # prompt right, early output wrong
    r = summarize(recs, ["a", "b"])
    assert r["signals"]["prompt"] == {"hits": 2, "mean_acceptance_lost": 0.0}
    assert r["signals"]["prompt_record"] == {"hits": 2, "mean_acceptance_lost": 0.0,
                                             "scorers_per_prompt": 2.0}  # no near ties
    assert r["signals"]["early_output"]["hits"] == 0
    assert r["signals"]["early_output"]["mean_acceptance_lost"] == pytest.approx(0.5)
    assert r["acceptance"]["a"] == {"all": pytest.approx(0.6), "best_fit": 0.9,
                                    "best_fit_requests": 1}


def test_the_record_breaks_near_ties_after_a_drafter_did_badly() -> None:
    # a and b predict every prompt almost equally; b is the better one on every output
    recs = [_rec(a=(0.5, 0.61, 0.0), b=(0.9, 0.60, 0.0)) for _ in range(6)]
    assert summarize(recs, ["a", "b"])["signals"]["prompt"]["hits"] == 0
    # untried drafters first: a once (it accepts 0.5), b once, then b on its record
    assert summarize(recs, ["a", "b"])["signals"]["prompt_record"]["hits"] == 5


def test_with_a_cost_model_the_record_ranks_by_goodput_and_reports_goodput_lost() -> None:
    cost = CostModel(verify=(0.010, 0.0, 1e-4, 0.0, 0.0),  # a drafts at 6 ms a level, b at 1
                     draft={"a": (0.0, 0.006, 0.0, 0.0), "b": (0.0, 0.001, 0.0, 0.0)})
    recs = [_rec(a=(0.8, 0.61, 0.0), b=(0.75, 0.60, 0.0)) for _ in range(4)]
    plain = summarize(recs, ["a", "b"])["signals"]
    assert "mean_goodput_lost" not in plain["prompt"]
    assert plain["prompt_record"]["hits"] == 3  # by acceptance: a, but b once while untried
    signals = summarize(recs, ["a", "b"], cost=cost)["signals"]
    assert signals["prompt"]["hits"] == 4 and signals["prompt"]["mean_goodput_lost"] > 0.2
    r = signals["prompt_record"]
    assert r["hits"] == 0 and r["mean_acceptance_lost"] == pytest.approx(0.05)
    assert r["mean_goodput_lost"] == pytest.approx(0.0)  # b: the cheaper one is the faster
    by_acceptance = LearnedPolicyConfig(fit_by_goodput=False)
    assert summarize(recs, ["a", "b"], by_acceptance, cost)["signals"]["prompt_record"][
        "mean_goodput_lost"] > 0.2


def test_fit_bench_on_the_demo_family(family_dir: Path) -> None:
    r = run_fit_bench(FitBenchConfig(family_dir=family_dir, prompts=3, new_tokens=12))
    assert r["prompts"] == 3 and len(r["per_request"]) == 3
    assert sum(v["best_fit_requests"] for v in r["acceptance"].values()) == 3
    for rec in r["per_request"]:
        for v in rec["drafters"].values():
            assert all(0.0 <= v[s] <= 1.0 for s in ("output", "prompt", "early_output"))
    assert all(0 <= s["hits"] <= 3 for s in r["signals"].values())


def test_the_replay_leaves_out_a_drafter_that_never_fits() -> None:
    """c fits none of the prompts it scores and sits out once it lost 4 (unless a or b lost
    their last 4 too: two must score), so fewer than 3 drafters score a prompt on average."""
    recs = [_rec(a=(0.9, 0.6 - 0.3 * (i % 2), 0.0), b=(0.8, 0.3 + 0.3 * (i % 2), 0.0),
                 c=(0.1, 0.1, 0.0)) for i in range(20)]
    pruned = LearnedPolicyConfig(fit_prune_after=4, fit_explore_every=0)
    r = summarize(recs, ["a", "b", "c"], pruned)["signals"]["prompt_record"]
    assert 2.0 < r["scorers_per_prompt"] < 2.5
    every = summarize(recs, ["a", "b", "c"], LearnedPolicyConfig(fit_prune_after=0))
    assert every["signals"]["prompt_record"]["scorers_per_prompt"] == 3.0
    assert r["hits"] == every["signals"]["prompt_record"]["hits"]


def test_the_deficit_weight_is_the_slope_of_acceptance_lost_on_agreement_behind() -> None:
    # b is 0.1 behind a's prompt agreement and 0.3 below its output acceptance, c 0.05 behind
    # and 0.15 below: slope 3; d, 0.5 behind, is left out (not a near tie)
    recs = [_rec(a=(0.9, 0.6, 0.0), b=(0.6, 0.5, 0.0), c=(0.75, 0.55, 0.0), d=(0.0, 0.1, 0.0))
            for _ in range(3)]
    r = summarize(recs, ["a", "b", "c", "d"])
    dw = r["deficit_weight"]
    assert dw["points"] == 6 and dw["slope"] == pytest.approx(3.0)
    assert set(dw["replay"]) == {"0", "1", "2", "3", "4", "6"}
    # the replay at the default weight is the prompt-record signal itself
    assert LearnedPolicyConfig().fit_deficit_weight == 3.0
    assert dw["replay"]["3"] == r["signals"]["prompt_record"]
