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

Suffix decoding is off (``policy_config.learned_router``): every configuration sends the same
prompts, and its store would draft the learned policy's requests from their earlier outputs.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from loadgen.workload import Request, build_workload

from ..serve import Embedded, ServeConfig
from ..verifier.decompose import decompose, padded_fraction
from .pipeline import pipeline, shared_cores
from .policy_config import GREEDY, PolicyBenchConfig, learned_router, run_requests
from .policy_goodput import LEARNED, goodput, model_and_lookup_drafters, warm_learned
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


def _cold_start(emb: Embedded, workload: list[Request], cfg: PolicyBenchConfig
                ) -> tuple[dict, int, list[list[int]]]:
    """The learned policy on the fresh deployment (empty Redis), per workload, against off:
    ``{workload: {"learned", "off"} tokens/s}``, greedy mismatches, off's greedy outputs. One
    request without speculation first warms the processes (it records no drafter
    statistics); greedy and sampled requests keep separate statistics, so the sampled run is
    cold as well after the greedy one."""
    run_requests(emb.endpoint, workload[:1], "off", 0, cfg, "warm-up", progress=False)
    tokens = len(workload) * cfg.new_tokens
    out: dict = {}
    mismatches, reference = 0, []
    for sampling in cfg.workloads:
        off, _ = run_requests(emb.endpoint, workload, "off", 0, cfg,
                              f"cold start: off ({sampling.name})", sampling=sampling)
        cold, _ = run_requests(emb.endpoint, workload, "auto", 0, cfg,
                               f"cold start: learned ({sampling.name})", sampling=sampling)
        if sampling == GREEDY:
            reference = [r.token_ids for r in off]
            mismatches = sum(r.token_ids != ref for r, ref in zip(cold, reference))
        out[sampling.name] = {"learned": tokens / sum(r.e2e_s for r in cold),
                              "off": tokens / sum(r.e2e_s for r in off)}
    return out, mismatches, reference


def run_policy_bench(cfg: PolicyBenchConfig, out_json: Path | None = None) -> dict:
    workload = build_workload(cfg.requests, seed=cfg.seed, family_dir=cfg.family_dir,
                              split="evaluation")
    log_dir = Path(tempfile.mkdtemp(prefix="spin-bench-policy-"))
    report: dict = {"requests": cfg.requests, "new_tokens": cfg.new_tokens, "quick": cfg.quick,
                    "split": "evaluation", "domains": sorted({w.domain for w in workload})}
    with contextlib.ExitStack() as stack:
        emb, mine = (stack.enter_context(Embedded(ServeConfig(
            family_dir=cfg.family_dir, port=0, log_dir=log_dir / name,
            router=learned_router(cost_model=cfg.cost_model)))) for name in ("shared", "learned"))
        fit_error = replica_fit_error(emb)
        drafters = model_and_lookup_drafters(emb)
        report["cold_start"], mismatches, reference = _cold_start(emb, workload, cfg)
        # 1. goodput, one request at a time, on each workload; the learned policy on its own
        # deployment, warmed on tuning prompts (policy_goodput.py)
        warm_learned(mine, workload, drafters, cfg, cfg.workloads)
        report["goodput"] = {}
        for sampling in cfg.workloads:
            section, wrong, _ = goodput(emb, workload, drafters, cfg, sampling,
                                        reference if sampling == GREEDY else None, mine)
            report["goodput"][sampling.name] = section
            mismatches += wrong
            if sampling.name in report["cold_start"]:
                cold = report["cold_start"][sampling.name]
                cold["warm_learned"] = section[LEARNED]
                cold["cold_over_warm"] = cold["learned"] / section[LEARNED]
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
