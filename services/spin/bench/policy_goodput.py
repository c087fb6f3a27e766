"""``spin bench policy``, goodput section: the learned policy against every fixed configuration.

Requests one after another through one deployment, ``rounds`` passes, each over every
configuration in turn (the machine's speed drifts; each pass sees the same drift), per request the
median over passes. The grid is every (drafter, k) the learned policy could use, k up to its
``k_max`` (16), each fixed k given the policy's early stopping (``Speculation.early_stop``), plus
speculation off. Compared with the learned policy (mode auto):

- **best fixed**: the one configuration fastest over all requests;
- **per-request best fixed**: each request's fastest configuration (off among them), which needs
  every configuration run on every request: no policy can know it in advance.

Both are chosen on some passes and timed on another (``held_out``), since the fastest of dozens of
configurations on the very runs it is timed on is a minimum over noise; chosen and timed on the
same passes they are reported too (``*_in_sample``). The sampled workload draws new seeds each
pass, the same in every configuration of the pass (``policy_config.round_seed``): otherwise the
pass a choice is timed on would replay the very outputs it was chosen on.

The learned policy runs on a deployment of its own (``learned``), warmed on **tuning** prompts
only (``warm_learned``: every drafter at k = 4 over a tuning workload, so its population
statistics in Redis know the drafters as a fleet's would, but not the prompts it is timed on;
then one pass of the timed prompts with speculation off, which records no drafter statistics but
fills the prefix cache as the fixed configurations' deployment has it). On the shared deployment
it would start from the statistics the fixed configurations left *on the very prompts timed*:
warm on what it is timed on. From its second pass on it has learnt from its own first (a router
learns from its traffic), so ``learned_first_pass`` reports that pass alone as well. ``spin
bench policy`` measures the cold start apart.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from loadgen.workload import Request, build_workload

from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..serve import Embedded, served_heads
from .policy_config import PolicyBenchConfig, Sampling, run_requests
from .services import _router_times

LEARNED = "learned"
OFF = "off"
PREDICTION_ERROR = "spin:step_prediction_error_ratio"


def grid(drafters: list[str], ks: tuple[int, ...]) -> list[tuple[str, str, int]]:
    """(name, speculation, k) of every configuration: off, each drafter at each k, learned."""
    return ([(OFF, "off", 0)] + [(f"{d}:k{k}", d, k) for d in drafters for k in ks]
            + [(LEARNED, "auto", 0)])


def warm_learned(learned: Embedded, workload: list[Request], drafters: list[str],
                 cfg: PolicyBenchConfig, workloads: tuple[Sampling, ...]) -> None:
    """Warm the learned policy's deployment (module doc): every drafter at k = 4 over a
    **tuning** workload as large as ``workload``, with each of ``workloads``' sampling (greedy
    and sampled requests keep separate statistics), then ``workload`` once with speculation
    off."""
    tuning = build_workload(len(workload), seed=cfg.seed, family_dir=cfg.family_dir,
                            split="tuning")
    for sampling in workloads:
        for d in drafters:
            run_requests(learned.endpoint, tuning, d, 4, cfg,
                         f"learned's warm-up: {d} ({sampling.name}, tuning prompts)",
                         sampling=sampling)
    run_requests(learned.endpoint, workload, "off", 0, cfg, "learned's warm-up: prefix cache")


def goodput(emb: Embedded, workload: list[Request], drafters: list[str],
            cfg: PolicyBenchConfig, sampling: Sampling,
            reference: list[list[int]] | None, learned_emb: Embedded | None = None
            ) -> tuple[dict, int, list[list[int]]]:
    """The section on ``workload`` with ``sampling``: its report, the lossless mismatches (greedy
    only: every output against ``reference``, or against the first off run when None) and the
    reference outputs. The learned policy runs on ``learned_emb`` (module doc; None: on
    ``emb``)."""
    mine = learned_emb or emb
    configs = grid(drafters, cfg.ks)
    e2e: dict[str, list[list[float]]] = {name: [] for name, _, _ in configs}
    mismatches = 0
    err_sum = err_count = 0.0
    learned: list = []
    greedy = sampling.temperature == 0
    for rnd in range(cfg.rounds):
        for name, spec, k in configs:
            on = mine if name == LEARNED else emb
            before = _router_times(on.router.metrics_port, (PREDICTION_ERROR,))
            res, _ = run_requests(on.endpoint, workload, spec, k, cfg,
                                  f"{sampling.name} {name} ({rnd + 1}/{cfg.rounds})",
                                  sampling=sampling, early_stop=spec not in (OFF, "auto"),
                                  rnd=rnd)
            if name == LEARNED:  # the cost model's error on the steps it predicted
                after = _router_times(on.router.metrics_port, (PREDICTION_ERROR,))
                err_sum += (after.get(PREDICTION_ERROR + "_sum", 0.0)
                            - before.get(PREDICTION_ERROR + "_sum", 0.0))
                err_count += (after.get(PREDICTION_ERROR + "_count", 0.0)
                              - before.get(PREDICTION_ERROR + "_count", 0.0))
                learned = res
            if reference is None:
                reference = [r.token_ids for r in res]  # speculation off, first round
            if greedy:
                mismatches += sum(r.token_ids != ref for r, ref in zip(res, reference))
            e2e[name].append([r.e2e_s for r in res])
    per_request = {name: medians(runs) for name, runs in e2e.items()}
    tokens = len(workload) * cfg.new_tokens  # every request generates new_tokens (ignore_eos)
    fixed = {name: runs for name, runs in e2e.items() if name != LEARNED}
    fixed_medians = {name: per_request[name] for name in fixed}
    by_config = {name: tokens / sum(times) for name, times in fixed_medians.items()}
    best = best_fixed(fixed_medians)[0]
    per_best = per_request_best(fixed_medians)
    best_s, per_best_s = held_out(fixed, best_fixed), held_out(fixed, per_request_best)
    learned_tps = tokens / sum(per_request[LEARNED])
    report = {
        "learned": learned_tps, "best_fixed": tokens / sum(best_s), "best_fixed_config": best,
        "best_fixed_in_sample": by_config[best],
        "per_request_best_fixed": tokens / sum(per_best_s),
        "per_request_best_fixed_in_sample": tokens / sum(per_request[c][i]
                                                         for i, c in enumerate(per_best)),
        "off": by_config[OFF],
        "learned_over_best_fixed": learned_tps / (tokens / sum(best_s)),
        "learned_first_pass": tokens / sum(e2e[LEARNED][0]),
        "learned_first_pass_over_best_fixed": sum(best_s) / sum(e2e[LEARNED][0]),
        "learned_deployment": "own, warmed on tuning prompts" if learned_emb else "shared",
        "learned_over_per_request_best_fixed": learned_tps / (tokens / sum(per_best_s)),
        "by_config": by_config, "rounds": cfg.rounds, "ks": list(cfg.ks),
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "mean_latency_s": {LEARNED: statistics.mean(per_request[LEARNED]),
                           "best_fixed": statistics.mean(best_s),
                           OFF: statistics.mean(per_request[OFF])},
        "learned_speculation": {
            "tau": tokens / max(1, sum(r.speculation.steps for r in learned)),
            "steps": sum(r.speculation.steps for r in learned),
            "steps_without_speculation": sum(r.speculation.steps_without_speculation
                                             for r in learned)},
        "cost_model_serving_mape": err_sum / err_count if err_count else None,
        "per_request": [
            {"domain": w.domain, "learned_s": per_request[LEARNED][i],
             "per_request_best_fixed_config": per_best[i],
             "per_request_best_fixed_s": per_best_s[i], "best_fixed_s": best_s[i],
             "learned_steps": r.speculation.steps,
             "learned_drafters": {d: c.steps for d, c in r.speculation.drafters.items()}}
            for i, (w, r) in enumerate(zip(workload, learned))]}
    return report, mismatches, reference


def model_and_lookup_drafters(emb: Embedded) -> list[str]:
    """The deployment's drafters: each drafter service's, the verifier's draft heads, then
    prompt lookup."""
    return [c.role.removeprefix("drafter-") for c in emb.children
            if c.role.startswith("drafter-")] + list(served_heads(emb.cfg)) + [PROMPT_LOOKUP]


def medians(runs: list[list[float]]) -> list[float]:
    """Per request, the median over rounds of ``runs[round][request]``."""
    return [statistics.median(x[i] for x in runs) for i in range(len(runs[0]))]


def per_request_best(per_request: dict[str, list[float]]) -> list[str]:
    """Each request's fastest configuration (speculation off among them)."""
    n = len(next(iter(per_request.values())))
    return [min(per_request, key=lambda c: per_request[c][i]) for i in range(n)]


def best_fixed(per_request: dict[str, list[float]]) -> list[str]:
    """The speculating configuration fastest over all requests, for every request."""
    best = min((c for c in per_request if c != OFF), key=lambda c: sum(per_request[c]))
    return [best] * len(per_request[best])


def held_out(e2e: dict[str, list[list[float]]],
             pick: Callable[[dict[str, list[float]]], list[str]]) -> list[float]:
    """Per request, the median over rounds r of the seconds, in round r, of the configuration
    that ``pick`` chooses from the other rounds' medians (from round r itself when there is one
    round): cross-fitting, which measures what knowing the best configuration is worth rather
    than which configuration was luckiest."""
    rounds = len(next(iter(e2e.values())))
    timed = []
    for r in range(rounds):
        others = [q for q in range(rounds) if q != r] or [r]
        chosen = pick({c: medians([runs[q] for q in others]) for c, runs in e2e.items()})
        timed.append([e2e[c][r][i] for i, c in enumerate(chosen)])
    return medians(timed)
