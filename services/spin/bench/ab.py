"""``spin bench ab``: two learned-policy settings side by side, request by request.

Tuning the policy means comparing settings whose effect (a few percent) is smaller than a shared
machine's drift between runs (easily 1.5x). So both settings run at once, as two ``spin serve``
deployments, and every request of the mixed workload (the **tuning** split of the held-out
prompts: ``spin bench policy`` times the evaluation split) goes to A, then to B, then (as a
reference) to prompt lookup at k = 4 on A, for ``rounds`` passes: each pair sees the same
moment's machine.
Before that, each deployment serves the workload once per drafter (k = 4), so both start from the
same kind of population statistics, as in ``spin bench policy``. The report: per request the
median end-to-end seconds of each, and the totals' ratios (B / A < 1: B is faster). Running A
against itself measures the noise floor. The workload is greedy, or sampled
(``ABConfig.sampling``, ``--sampled``: the headline workload of ``spin bench policy``), with the
same seeds on A, B and the reference, new ones each pass (``policy_config.round_seed``).
Both deployments run without suffix decoding (``policy_config.learned_router``): every request
is sent again and again, and its store would draft each one from its earlier outputs.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from loadgen.workload import build_workload

from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..serve import Embedded, ServeConfig
from ..zoo.specs import FAMILY_DIR
from .policy_config import GREEDY, PolicyBenchConfig, Sampling, learned_router, run_requests
from .policy_goodput import model_and_lookup_drafters


@dataclass
class ABConfig:
    """What the A/B comparison runs."""

    a: str = "{}"
    """Setting A: JSON overrides of the learned policy (``spin router --policy-config``)."""
    b: str = "{}"
    """Setting B, the same way."""
    rounds: int = 3
    """Passes over the workload (per-request medians)."""
    requests: int = 9
    """Requests of the mixed workload (code, prose, structured)."""
    new_tokens: int = 64
    """Tokens generated per request."""
    sampling: Sampling = GREEDY
    """The workload's sampling (``SAMPLED``: request ``i`` of pass ``r`` samples with seed
    ``round_seed(0, r) + i`` on A, B and the reference alike)."""
    seed: int = 0
    """Seed of the mixed workload (drawn from the tuning split)."""
    family_dir: Path = FAMILY_DIR
    """The model family both deployments serve."""
    cost_model: Path | None = None
    """A cost model file both deployments' learned policies use; None: each router fits one
    from its services' step times."""


def run_ab(cfg: ABConfig) -> dict:
    """Run the comparison; the report (module doc) as a dict."""
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              cost_model=cfg.cost_model)
    workload = build_workload(cfg.requests, seed=cfg.seed, family_dir=cfg.family_dir,
                              split="tuning")

    def deployment(overrides: str) -> Embedded:
        router = learned_router(json.loads(overrides), cfg.cost_model)
        return Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                                    log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-ab-"))))

    times: dict[str, list[list[float]]] = {"a": [[] for _ in workload], "b": [[] for _ in workload],
                                           "prompt_lookup": [[] for _ in workload]}
    with deployment(cfg.a) as ea, deployment(cfg.b) as eb:
        drafters = model_and_lookup_drafters(ea)  # the draft heads too
        for emb, name in ((ea, "A"), (eb, "B")):
            for d in drafters:  # population statistics, as in `spin bench policy`
                run_requests(emb.endpoint, workload, d, 4, bench, f"{name}: warm-up {d}",
                             sampling=cfg.sampling)
        runs = (("a", ea, "auto", 0), ("b", eb, "auto", 0), ("prompt_lookup", ea, PROMPT_LOOKUP, 4))
        with tqdm(total=cfg.rounds * len(workload), desc="A/B pairs", unit="req") as bar:
            for rnd in range(cfg.rounds):
                for i, w in enumerate(workload):
                    for key, emb, spec, k in runs:
                        (res,), _ = run_requests(emb.endpoint, [w], spec, k, bench, key,
                                                 progress=False, sampling=cfg.sampling, rnd=rnd)
                        times[key][i].append(res.e2e_s)
                    bar.update()
    median = {key: [statistics.median(x) for x in per] for key, per in times.items()}
    total = {key: sum(v) for key, v in median.items()}
    return {"a": json.loads(cfg.a), "b": json.loads(cfg.b), "rounds": cfg.rounds, "seed": cfg.seed,
            "sampling": cfg.sampling.name,
            "requests": [{"domain": w.domain, **{k: median[k][i] for k in median}}
                         for i, w in enumerate(workload)],
            "total_s": total, "b_over_a": total["b"] / total["a"],
            "prompt_lookup_over_a": total["prompt_lookup"] / total["a"],
            "prompt_lookup_over_b": total["prompt_lookup"] / total["b"]}
