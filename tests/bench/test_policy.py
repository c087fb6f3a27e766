"""The policy benchmark's accounting: the per-request best and the best fixed configuration,
chosen on some passes and timed on another; the grid; the pipeline section on a small batch."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spin.bench.pipeline import pipeline, shared_cores
from loadgen.workload import build_workload
from spin.bench.policy_config import (GREEDY, SAMPLED, PolicyBenchConfig, learned_router,
                                      round_seed, run_requests)
from spin.bench import policy_goodput
from spin.bench.policy_goodput import (best_fixed, goodput, grid, held_out, medians,
                                       model_and_lookup_drafters, per_request_best,
                                       warm_learned)
from spin.bench.scrape import scrape
from spin.bench.policy_sweep import load_sweep
from spin.engine.prompt_lookup import PROMPT_LOOKUP
from spin.policy.goodput import ControllerConfig
from spin.router.config import RouterConfig
from spin.serve import Embedded, ServeConfig
from spin.zoo.corpus import heldout_prompts, prompt_split
from spin.zoo.specs import FAMILY_DIR

# seconds[config][pass][request]: "a" is truly faster on request 0 and "b" on request 1, but in
# pass 1 "b" got lucky on request 0 (a minimum over noise)
E2E = {"off": [[2.0, 2.0], [2.0, 2.0]],
       "a": [[1.0, 1.6], [1.0, 1.6]],
       "b": [[1.2, 1.0], [0.6, 1.0]]}


def test_the_in_sampleper_request_best_keeps_the_lucky_run() -> None:
    med = {c: medians(runs) for c, runs in E2E.items()}
    assert med["b"] == [pytest.approx(0.9), 1.0]
    assert per_request_best(med) == ["b", "b"]  # b's lucky pass makes it request 0's best
    assert best_fixed(med) == ["b", "b"]


def testheld_out_times_each_pass_with_the_choice_of_the_others() -> None:
    # pass 0 is timed with pass 1's choice (b: 1.2 s), pass 1 with pass 0's (a: 1.0 s)
    assert held_out(E2E, per_request_best) == [pytest.approx(1.1), 1.0]
    assert held_out(E2E, best_fixed) == [pytest.approx(0.9), 1.0]  # b on both: no choice differs
    one = {c: runs[:1] for c, runs in E2E.items()}  # one pass: chosen and timed on it
    assert held_out(one, per_request_best) == [1.0, 1.0]


def test_benchmarks_that_repeat_their_prompts_run_without_suffix_decoding(
        tmp_path: Path) -> None:
    # its store would draft a repeated request from the output an earlier configuration gave it
    assert RouterConfig().scheduler.suffix_decoding is True  # the serving default differs
    r = learned_router({"k_max": 8}, tmp_path / "cost.json")
    assert r.scheduler.suffix_decoding is False and r.policy == "learned"
    assert r.policy_config == {"k_max": 8} and r.cost_model == str(tmp_path / "cost.json")
    assert learned_router().policy_config == {} and learned_router().cost_model is None


def test_the_grid_covers_every_k_the_learned_policy_may_use() -> None:
    k_max = ControllerConfig().k_max
    assert PolicyBenchConfig().ks == tuple(range(1, k_max + 1))
    quick = PolicyBenchConfig(quick=True).ks
    assert quick[0] == 1 and quick[-1] == k_max
    names = [name for name, _, _ in grid(["d1", "prompt-lookup"], (1, 16))]
    assert names == ["off", "d1:k1", "d1:k16", "prompt-lookup:k1", "prompt-lookup:k16",
                     "learned"]


class SmallBatch(PolicyBenchConfig):
    @property
    def pipeline_requests(self) -> int:
        return 4


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="splitting cores needs 2")
def test_pipeline_section_on_a_small_batch(tmp_path: Path, family_dir: Path) -> None:
    """Shared and split deployments, one and two micro-batches: every output is the target's,
    steps are counted per request (about the same in every run), and a step is wall time over
    them."""
    cfg = SmallBatch(family_dir=family_dir, new_tokens=12)
    with Embedded(ServeConfig(family_dir=family_dir, port=0, drafters=["draft-code"],
                              router=RouterConfig(policy="fixed"), redis=False,
                              log_dir=tmp_path / "shared")) as emb:
        shared = shared_cores(emb, cfg)
    assert set(shared) == {"one", "two"} and shared["one"][0] == shared["two"][0]
    report, mismatches = pipeline(cfg, tmp_path, shared)
    assert mismatches == 0
    assert report["requests"] == 4 and report["cpus"]["verifier"]
    on, one = report["runs"]["on"], report["runs"]["off"]
    # the same drafter and k; drafts may differ a little with the batches' composition
    assert on["steps"] > 1 and one["steps"] > 1 and abs(on["steps"] - one["steps"]) <= 2
    assert report["step_s"] == pytest.approx(on["wall_s"] / on["steps"])
    assert one["lane_steps"] >= one["steps"] and on["lane_steps"] > on["steps"]  # two lanes
    assert report["max_draft_verify_s"] == max(report["draft_s"], report["verify_s"]) > 0
    assert set(report["tokens_per_s_shared_cores"]) == {"one", "two"}


class Tiny(PolicyBenchConfig):
    requests = 2
    rounds = 2
    ks = (2,)
    load_fractions = (2.0,)
    sweep_requests = 4


def test_goodput_and_sweep_sections_on_the_shared_deployment(serving: Embedded) -> None:
    """Every configuration of the grid runs on evaluation prompts; greedy outputs all equal off's;
    the ratios are the report's own numbers; the sweep goes to twice the measured capacity."""
    cfg = Tiny(new_tokens=8)
    workload = build_workload(cfg.requests, seed=0, split="evaluation")
    assert all(prompt_split(_id(w.prompt)) == "evaluation" for w in workload)
    drafters = model_and_lookup_drafters(serving)
    assert PROMPT_LOOKUP in drafters and len(drafters) >= 2
    report, mismatches, reference = goodput(serving, workload, drafters, cfg, GREEDY, None)
    assert mismatches == 0 and len(reference) == 2 and all(len(t) == 8 for t in reference)
    assert set(report["by_config"]) == {"off"} | {f"{d}:k2" for d in drafters}
    assert report["learned_over_best_fixed"] == pytest.approx(
        report["learned"] / report["best_fixed"])
    assert report["best_fixed_config"] != "off"
    assert {r["per_request_best_fixed_config"] for r in report["per_request"]} <= set(
        report["by_config"])
    sampled, wrong, _ = goodput(serving, workload, drafters, cfg, SAMPLED, None)
    assert wrong == 0 and sampled["temperature"] == 0.8 and sampled["top_p"] == 0.95
    sweep, mismatches = load_sweep(serving, cfg)
    assert mismatches == 0 and sweep["requests_per_rate"] == 4
    (row,) = sweep["rates"]
    assert row["rate"] == pytest.approx(2.0 * sweep["capacity_req_s"])
    assert row["auto_not_worse"] == (row["auto_mean_latency_s"] <= row["off_mean_latency_s"]
                                     and row["auto_p99_latency_s"] <= row["off_p99_latency_s"])


def _finished(emb: Embedded) -> float:
    """Requests the deployment's router has finished, by every reason."""
    return sum(v for k, v in scrape(emb.router.metrics_port).items()
               if k.startswith("spin:request_success_total"))


def test_the_learned_policy_runs_on_its_own_deployment_warmed_on_tuning_prompts(
        serving: Embedded, serving_model_drafters: Embedded,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its Redis learns the drafters on tuning prompts, never from the fixed configurations'
    runs of the prompts it is timed on; those run on the other deployment."""
    cfg, mine = Tiny(new_tokens=8), serving_model_drafters
    workload = build_workload(cfg.requests, seed=0, split="evaluation")
    splits: list[str] = []

    def recording(*args, split, **kwargs):  # type: ignore[no-untyped-def]
        splits.append(split)
        return build_workload(*args, split=split, **kwargs)

    monkeypatch.setattr(policy_goodput, "build_workload", recording)
    shared0, mine0 = _finished(serving), _finished(mine)
    warm_learned(mine, workload, [PROMPT_LOOKUP], cfg, (GREEDY, SAMPLED))
    assert splits == ["tuning"]  # the timed prompts only pass once, speculation off
    assert _finished(mine) - mine0 == 2 * len(workload) + len(workload)
    report, mismatches, _ = goodput(serving, workload, [PROMPT_LOOKUP], cfg, GREEDY, None, mine)
    runs = cfg.rounds * len(workload)
    assert mismatches == 0 and report["learned_deployment"] == "own, warmed on tuning prompts"
    assert _finished(mine) - mine0 == 3 * len(workload) + runs  # + the learned passes
    assert _finished(serving) - shared0 == 2 * runs  # off and prompt-lookup:k2 only
    assert report["learned_first_pass"] > 0 and report["learned_first_pass_over_best_fixed"] > 0


def test_each_pass_of_a_sampled_workload_draws_new_outputs(serving: Embedded) -> None:
    """A pass replays its own seeds (every configuration of a pass samples the same way), and
    the next pass draws new ones, so a choice timed on another pass cannot keep the luck of the
    outputs it was chosen on; greedy outputs are the same in every pass."""
    cfg = Tiny(new_tokens=8)
    workload = build_workload(2, seed=0, split="evaluation")

    def outputs(sampling, rnd: int) -> list[list[int]]:
        res, _ = run_requests(serving.endpoint, workload, "off", 0, cfg, "pass",
                              progress=False, sampling=sampling, rnd=rnd)
        return [r.token_ids for r in res]

    first = outputs(SAMPLED, 0)
    assert outputs(SAMPLED, 0) == first != outputs(SAMPLED, 1)
    assert outputs(GREEDY, 0) == outputs(GREEDY, 1)
    assert round_seed(5, 0) == 5 and round_seed(5, 2) - round_seed(5, 1) > cfg.requests


def test_the_sweep_alone_on_tuning_prompts(serving: Embedded,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``spin bench sweep``'s section: the tuning split's prompts at the fractions asked for."""
    from spin.bench import policy_sweep

    splits: list[str] = []

    def recording(*args, split, **kwargs):  # type: ignore[no-untyped-def]
        splits.append(split)
        rows = build_workload(*args, split=split, **kwargs)
        assert all(prompt_split(_id(w.prompt)) == split for w in rows)
        return rows

    monkeypatch.setattr(policy_sweep, "build_workload", recording)
    sweep, mismatches = load_sweep(serving, Tiny(new_tokens=8), "tuning", (0.5,))
    assert splits == ["tuning"] and mismatches == 0 and sweep["split"] == "tuning"
    assert [r["load_fraction"] for r in sweep["rates"]] == [0.5]
    assert sweep["rates"][0]["rate"] == pytest.approx(0.5 * sweep["capacity_req_s"])


def _id(prompt: str) -> str:
    """The held-out prompt id of a prompt text."""
    return next(r["id"] for r in heldout_prompts(FAMILY_DIR) if r["prompt"] == prompt)
