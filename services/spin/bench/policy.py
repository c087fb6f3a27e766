"""``spin bench policy``: the learned policy against fixed choices, on the embedded services.

One ``spin serve`` deployment (learned policy in the router), a mixed workload of code, prose and
structured prompts from the **evaluation** split of the held-out prompts (``zoo.corpus
.prompt_split``; tuning tools such as ``spin bench ab`` and ``spin bench fit`` use the tuning
split, disjoint by document), ``new_tokens`` each. Measured in one run:

0. **Cold start**: on the fresh deployment (empty Redis, nothing learned), the learned policy's
   goodput on the workload, before anything else ran.
1. **Goodput** (``policy_goodput.py``), greedy and sampled (temperature 0.8, top-p 0.95, seeded):
   the learned policy against the best fixed configuration and the per-request best fixed one,
   over every (drafter, k <= 16) with the policy's early stopping, and speculation off.
2. **Load** (``policy_sweep.py``): auto against off from light load to twice the batched capacity
   of speculation off; a PNG plot next to the JSON.
3. The cost model's error (MAPE): its fit on its own profile, and in serving (predicted vs
   measured time of the learned policy's steps, router metrics); lossless mismatches: every
   greedy output of the run compared with speculation off.
4. Pipelining (``pipeline.py``, on a deployment of its own with the cores split between the
   verifier and the drafting side) and request decomposition (``_decomposition``), each on vs
   off.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from loadgen.workload import build_workload

from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig
from ..verifier.decompose import decompose, padded_fraction
from .pipeline import pipeline, shared_cores
from .policy_config import GREEDY, PolicyBenchConfig, run_requests
from .policy_goodput import LEARNED, goodput, model_and_lookup_drafters
from .policy_sweep import load_sweep, plot_sweep


def replica_fit_error(emb: Embedded) -> dict[str, float]:
    """The fit error of the cost model the router fits from what the services report."""
    from ..router.cost import ReplicaCosts
    from ..v1 import drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc

    costs = ReplicaCosts(None, 0.0)
    for c in emb.children:
        with grpc.insecure_channel(f"127.0.0.1:{c.port}") as ch:
            if c.role == "verifier":
                costs.verify = []
                costs.verifier(verifier_pb2_grpc.VerifierStub(ch).GetVerifierInfo(
                    verifier_pb2.GetVerifierInfoRequest(), timeout=30).info)
            elif c.role.startswith("drafter-"):
                name = c.role.removeprefix("drafter-")
                costs.drafter(name, drafter_pb2_grpc.DrafterStub(ch).GetDrafterInfo(
                    drafter_pb2.GetDrafterInfoRequest(), timeout=30).info)
    return costs.fit_error()


def run_policy_bench(cfg: PolicyBenchConfig, out_json: Path | None = None) -> dict:
    workload = build_workload(cfg.requests, seed=cfg.seed, family_dir=cfg.family_dir,
                              split="evaluation")
    log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-policy-"))
    report: dict = {"requests": cfg.requests, "new_tokens": cfg.new_tokens, "quick": cfg.quick,
                    "split": "evaluation", "domains": sorted({w.domain for w in workload})}
    with Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, log_dir=log_dir,
                              router=RouterConfig(policy="learned", cost_model=(
                                  str(cfg.cost_model) if cfg.cost_model else None)))) as emb:
        fit_error = replica_fit_error(emb)
        drafters = model_and_lookup_drafters(emb)
        # 0. cold start: one request without speculation warms the processes (it records no
        # drafter statistics), then the learned policy on an empty Redis
        run_requests(emb.endpoint, workload[:1], "off", 0, cfg, "warm-up", progress=False)
        off, _ = run_requests(emb.endpoint, workload, "off", 0, cfg, "cold start: off")
        cold, _ = run_requests(emb.endpoint, workload, "auto", 0, cfg, "cold start: learned")
        reference = [r.token_ids for r in off]
        mismatches = sum(r.token_ids != ref for r, ref in zip(cold, reference))
        tokens = len(workload) * cfg.new_tokens
        report["cold_start"] = {"learned": tokens / sum(r.e2e_s for r in cold),
                                "off": tokens / sum(r.e2e_s for r in off)}
        # 1. goodput, one request at a time, on each workload
        report["goodput"] = {}
        for sampling in cfg.workloads:
            section, wrong, _ = goodput(emb, workload, drafters, cfg, sampling,
                                        reference if sampling == GREEDY else None)
            report["goodput"][sampling.name] = section
            mismatches += wrong
        if GREEDY.name in report["goodput"]:
            warm = report["goodput"][GREEDY.name][LEARNED]
            report["cold_start"]["warm_learned"] = warm
            report["cold_start"]["cold_over_warm"] = report["cold_start"]["learned"] / warm
        # 2. load sweep up to twice the batched capacity of speculation off
        report["sweep"], wrong = load_sweep(emb, cfg)
        mismatches += wrong
        shared = shared_cores(emb, cfg)
    report["pipeline"], wrong = pipeline(cfg, log_dir, shared)
    mismatches += wrong
    # the fit's error on its own points (the services' step times, or the profile's); the
    # serving error is each goodput section's (predicted vs measured learned steps)
    report["cost_model_mape"] = (json.loads(cfg.cost_model.read_text()).get("fit_mape")
                                 if cfg.cost_model else fit_error)
    report["lossless_mismatches"] = mismatches
    report["decomposition"] = _decomposition(cfg)
    if out_json is not None:
        out_json.write_text(json.dumps(report, indent=2))
        plot_sweep(report["sweep"], out_json.with_suffix(".png"))
    return report


def _decomposition(cfg: PolicyBenchConfig, decoding: int = 15, reps: int = 5) -> dict:
    """A verification batch of ``decoding`` requests scoring 5 tokens after ~300 of context plus
    one new request prefilling a 200-token prompt: one padded forward vs the decomposed ones."""
    from ..engine.model_runner import RunnerConfig
    from ..v1 import token_tree_pb2, verifier_pb2
    from ..verifier.server import VerifierService

    out = {}
    for on in (False, True):
        svc = VerifierService(cfg.family_dir / "target", RunnerConfig(max_seqs=decoding + 2),
                              decompose=on)
        ctx = {f"d{i}": list(range(10 + i, 310 + i)) for i in range(decoding)}
        svc.run_batch(verifier_pb2.VerifyRequest(tasks=[
            verifier_pb2.VerifyTask(request_id=r, context_delta=c) for r, c in ctx.items()]))
        times = []
        for rep in range(reps + 1):
            tree = token_tree_pb2.TokenTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 1, 2])
            tasks = [verifier_pb2.VerifyTask(request_id=r, keep=svc.verifier.seqs.held(r), tree=tree)
                     for r in ctx]
            tasks.append(verifier_pb2.VerifyTask(request_id=f"new{rep}",
                                                 context_delta=list(range(40, 240))))
            start = time.perf_counter()
            svc.run_batch(verifier_pb2.VerifyRequest(tasks=tasks, release=[f"new{rep - 1}"]))
            times.append(time.perf_counter() - start)
        sizes = [(5, 305)] * decoding + [(200, 200)]
        groups = (decompose(sizes, svc.cost_model.predict_padded_verify) if on
                  else [list(range(len(sizes)))])
        out["on" if on else "off"] = {"step_s": statistics.median(times[1:]),
                                      "padded_fraction": padded_fraction(sizes, groups),
                                      "forwards": len(groups)}
    return out
