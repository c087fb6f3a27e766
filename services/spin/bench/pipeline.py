"""SPIN's pipeline measured (``spin bench policy``, section 4): a concurrent batch through a router
with one micro-batch and through a second router with two, one drafted while the other is
verified; on the benchmark's own deployment (cores shared) and on one whose cores are split
between the verifier and the drafting side."""

from __future__ import annotations

from pathlib import Path

from loadgen.workload import Request, build_workload

from ..cpus import available_cpus, format_cpus, split
from ..router.config import RouterConfig
from ..serve import Embedded, ServeConfig, spin_argv
from ..supervisor import Child
from .policy_config import PolicyBenchConfig, run_requests
from .services import _router_times


def _pipeline_batch(cfg: PolicyBenchConfig) -> list[Request]:
    """The pipeline section's concurrent requests (the same on both deployments)."""
    return build_workload(cfg.pipeline_requests, seed=cfg.seed, family_dir=cfg.family_dir,
                          split="evaluation")


def _pipelined_router(emb: Embedded, cfg: PolicyBenchConfig, cpus: str | None) -> Child:
    """A second router over ``emb``'s verifier and the pipeline drafter, with two
    micro-batches."""
    name = cfg.pipeline_drafter
    verifier, drafter = emb.child("verifier", "verifier"), emb.child("drafter", name)
    piped = Child("router-pipelined", spin_argv(
        "router", "--verifier", f"127.0.0.1:{verifier.port}", "--tokenizer",
        str(cfg.family_dir / "target"), "--port", "0", "--metrics-port", "0", "--policy",
        "fixed", "--micro-batches", "2", "--drafter", f"{name}=127.0.0.1:{drafter.port}",
        *(("--cpus", cpus) if cpus else ())), emb.cfg.log_dir, None)
    try:
        piped.wait_ready(120)
    except BaseException:
        piped.stop(10)
        raise
    return piped


def shared_cores(emb: Embedded,
                  cfg: PolicyBenchConfig) -> dict[str, tuple[list[list[int]], float]]:
    """The pipeline section's batch (the pipeline drafter, k=4) on the benchmark's own
    deployment, whose processes share every core, through its router (one micro-batch) and
    through a second router with two: each run's outputs and tokens/s."""
    batch = _pipeline_batch(cfg)
    piped = _pipelined_router(emb, cfg, None)
    out = {}
    try:
        for name, port in (("one", emb.router.port), ("two", piped.port)):
            res, wall = run_requests(f"127.0.0.1:{port}", batch, cfg.pipeline_drafter, 4, cfg,
                             f"pipeline: shared cores, {name} micro-batch(es)",
                             concurrency=len(batch))
            out[name] = ([r.token_ids for r in res], sum(len(r.token_ids) for r in res) / wall)
    finally:
        piped.stop(10)
    return out


def pipeline(cfg: PolicyBenchConfig, log_dir: Path,
              shared: dict[str, tuple[list[list[int]], float]]) -> tuple[dict, int]:
    """SPIN's pipeline on a deployment of its own whose cores are split (``cpus.split``): the
    verifier on cores of its own, the pipeline drafter and the routers on the others, as a GPU
    verifier beside CPU-side drafting would be. The same concurrent batch (that drafter, k=4)
    through its
    router with one micro-batch and through a second router with two (one drafted while the
    other is verified). ``shared``: that batch on the benchmark's own deployment (cores shared,
    ``shared_cores``), for comparison. Returns the report and the lossless mismatches (every
    output against speculation off on the split deployment).

    A step of a run is the wall time over the most steps any of its requests took: the time to
    advance every running request by one step (both runs take about the same steps per
    request: the same drafter and k, but a draft model's tokens may differ with its batch's
    composition, floating point being what it is, and acceptance with them). ``draft_s`` and ``verify_s`` are the one-micro-batch
    run's means per step, from the router's metrics."""
    cpus = available_cpus()
    if len(cpus) < 2:
        return {"skipped": f"needs 2 cores, this process has {format_cpus(cpus)}"}, 0
    side, own = split(cpus)
    workload = _pipeline_batch(cfg)
    out: dict = {"cpus": {"drafters_and_routers": format_cpus(side),
                          "verifier": format_cpus(own)}, "requests": len(workload),
                "drafter": cfg.pipeline_drafter}
    with Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, log_dir=log_dir / "pipeline",
                              drafters=[cfg.pipeline_drafter], router=RouterConfig(policy="fixed"),
                              redis=False, cpus="split")) as emb:
        piped = _pipelined_router(emb, cfg, format_cpus(side))
        try:
            off, _ = run_requests(emb.endpoint, workload, "off", 0, cfg, "pipeline: speculation off",
                          concurrency=len(workload))
            reference = [r.token_ids for r in off]
            mismatches = sum(o != ref for outputs, _ in shared.values()
                             for o, ref in zip(outputs, reference))
            runs = {}
            for name, port, metrics_port in (("off", emb.router.port, emb.router.metrics_port),
                                             ("on", piped.port, piped.metrics_port)):
                before = _router_times(metrics_port)
                res, wall = run_requests(f"127.0.0.1:{port}", workload, cfg.pipeline_drafter, 4, cfg,
                                 f"pipeline {name}", concurrency=len(workload))
                d = {k: v - before.get(k, 0.0) for k, v in _router_times(metrics_port).items()}
                mismatches += sum(r.token_ids != ref for r, ref in zip(res, reference))
                steps = max(r.speculation.steps for r in res)
                calls = d["spin:step_seconds_count"]  # draft -> verify rounds of all lanes
                runs[name] = {"wall_s": wall, "steps": steps, "step_s": wall / steps,
                              "tokens_per_s": sum(len(r.token_ids) for r in res) / wall,
                              "lane_steps": calls,
                              "lane_draft_s": d["spin:step_draft_seconds_sum"] / calls,
                              "lane_verify_s": d["spin:step_verify_seconds_sum"] / calls}
        finally:
            piped.stop(10)
    on, one = runs["on"], runs["off"]
    out.update({"step_s": on["step_s"], "step_s_unpipelined": one["step_s"],
                "draft_s": one["lane_draft_s"], "verify_s": one["lane_verify_s"],
                "max_draft_verify_s": max(one["lane_draft_s"], one["lane_verify_s"]),
                "tokens_per_s_on": on["tokens_per_s"], "tokens_per_s_off": one["tokens_per_s"],
                "tokens_per_s_shared_cores": {n: tps for n, (_, tps) in shared.items()},
                "runs": runs})
    return out, mismatches
