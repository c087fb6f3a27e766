"""``spin bench gpu``: what the project's own forward and services do on one accelerator.

Parts (each selectable, each within its own time budget, run in this order):

- ``target``: a random-initialised Llama-3-8B-shape target alone at batch 1, decode tokens/s
  through ``ModelRunner`` with CUDA graphs off and on, against the **HBM limit** (weight bytes
  over the device's measured copy bandwidth, bytes read plus written);
- ``verify``: one verification forward of 1, 2, 4, 8, 16 chained tokens and of a 16-node tree
  per request at batch 1/8/32/64, graphs off and on (bar: time(8) / time(1) <= 1.3 at batch 1);
- ``baselines``: transformers' ``generate`` and assisted generation on the same shapes, and the
  demo family in process (HF generate, HF assisted, the engine alone and speculating);
- ``e2e``: the demo family through ``spin serve``'s processes on the device, speculation auto vs
  off, single stream and concurrent, greedy outputs compared (``bench/grid.py``'s cells);
- ``services``: in process vs through the services (``bench/services.py``);
- ``drafters``: ~68M, ~160M and ~1.2B-parameter shapes decoding at batch 1..64, graphs off and
  on (bar: graphs >= 2x eager at batch 1).

The report (``gpu_report.py`` prints it) is written as JSON after every part, with the device
name, torch version and date; a part that fails is recorded with its error and the run goes on.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .gpu_config import GpuBenchConfig
from .gpu_run import Run
from .gpu_runner import (Loaded, decode_step_s, graph_replay_s, open_runner, ratio_8_over_1,
                         release_memory, verify_rows)
from .gpu_shapes import Budget, Shape, build_random, copy_bandwidth

def run_gpu_bench(cfg: GpuBenchConfig, say: Callable[[str], None] = print) -> dict:
    """Every selected part; the report (also written to ``cfg.json_path`` after each part)."""
    from .gpu_serving import baselines_part, e2e_part, services_part

    run = Run(cfg, say)
    parts = cfg.selected
    say(f"spin bench gpu on {run.report['meta']['device_name']} ({run.device}, "
        f"{run.dtype_name}), parts {','.join(parts)}, budget {cfg.budget_s:.0f} s")
    if {"target", "verify", "baselines"} & set(parts):
        target_parts(run, parts, baselines_part)
    for name, fn in (("e2e", e2e_part), ("services", services_part),
                     ("drafters", drafters_part)):
        if name not in parts:
            continue
        if run.total.left() < 5:
            run.skip(name, f"the run's budget of {cfg.budget_s:.0f} s is spent")
            continue
        say(f"[{name}] ...")
        run.timed(name, lambda fn=fn, name=name: fn(run, run.budget(name)))
        say(f"[{name}] {run.part(name)['wall_s']:.1f} s")
    run.report["wall_s"] = run.total.elapsed()
    run.write()
    return run.report


def target_parts(run: Run, parts: tuple[str, ...],
                 baselines: Callable[[Run, Budget, torch.nn.Module], None]) -> None:
    """target, verify and baselines: one random target model shared by the three."""
    cfg, shape = run.cfg, run.cfg.target_shape
    first = next(p for p in ("target", "verify", "baselines") if p in parts)
    holder: dict = {}
    if run.total.left() < 5:
        for p in ("target", "verify", "baselines"):
            if p in parts:
                run.skip(p, f"the run's budget of {cfg.budget_s:.0f} s is spent")
        return

    def build() -> None:
        run.say(f"[{first}] building {shape.name} ({shape.params / 1e9:.2f}B parameters) "
                f"on {run.device} in {run.dtype_name} ...")
        t0 = time.perf_counter()
        holder["model"] = build_random(shape, run.device, run.dtype, max_len=cfg.max_model_len)
        entry = run.part(first)
        entry["build_s"] = time.perf_counter() - t0
        entry["shape"] = shape.as_dict()

    run.timed(first, build)
    if "model" not in holder:
        for p in ("target", "verify", "baselines"):
            if p in parts and p != first:
                run.skip(p, f"building the model failed (see {first})")
        return
    for graphs, attention in VARIANTS:
        if attention == "flex" and run.device.type != "cuda":
            continue  # eager flex (torch's reference implementation) measures nothing
        if "verify" in parts or ("target" in parts and attention == "sdpa"):
            _one_runner(run, parts, holder["model"], graphs, attention)
    if "baselines" in parts:
        run.timed("baselines", lambda: baselines(run, run.budget("baselines"), holder["model"]))
    holder.clear()
    release_memory()
    for p in ("target", "verify", "baselines"):
        if p in parts:
            run.say(f"[{p}] {run.part(p)['wall_s']:.1f} s")


VARIANTS = ((False, "sdpa"), (True, "sdpa"), (True, "flex"))
"""(CUDA graphs, attention) of the target's runners: decode on the first two, verification on
all three (flex against SDPA over gathered keys chooses ``--attention``'s default on CUDA)."""


def _one_runner(run: Run, parts: tuple[str, ...], model: torch.nn.Module, graphs: bool,
                attention: str = "sdpa") -> None:
    """The target part's decode and the verify part's points on one runner (graphs off or
    on); building it counts to the target part (to verify without it)."""
    opened: list[Loaded] = []
    decode = "target" in parts and attention == "sdpa"
    owner = "target" if decode else "verify"
    spec = run.runner_spec(run.cfg.kv_cache_memory)
    run.timed(owner, lambda: opened.append(open_runner(model, spec, graphs, attention)))
    if not opened:
        return
    try:
        if decode:
            run.timed("target", lambda: _decode(run, opened[0]))
        if "verify" in parts:
            run.timed("verify", lambda: _verify(run, opened[0]))
    finally:
        opened[0].close()


def _decode(run: Run, ld: Loaded) -> None:
    cfg, entry = run.cfg, run.part("target")
    if "bandwidth_bytes_s" not in entry:
        bw = copy_bandwidth(run.device, cfg.bandwidth_bytes)
        entry.update(bandwidth_bytes_s=bw, weight_bytes=ld.runner.weight_bytes,
                     hbm_limit_ms=1e3 * ld.runner.weight_bytes / bw, rows=[])
    step = decode_step_s(ld.runner, 1, cfg.decode_context, cfg.decode_tokens, cfg.reps)
    graph = graph_replay_s(ld.runner, 1, cfg.decode_context + cfg.decode_tokens, cfg.reps)
    row = {**ld.info(), "batch": 1, "step_ms": 1e3 * step, "tok_s": 1 / step,
           "vs_hbm_limit": entry["hbm_limit_ms"] / (1e3 * step),
           "graph_ms": None if graph is None else 1e3 * graph}
    entry["rows"].append(row)
    run.say(f"[target] graphs {'on ' if ld.graphs else 'off'}: {row['tok_s']:.1f} tok/s "
            f"({row['step_ms']:.2f} ms/step; HBM limit {entry['hbm_limit_ms']:.2f} ms, "
            f"{row['vs_hbm_limit']:.2f} of it"
            + (f"; the graph alone {row['graph_ms']:.2f} ms" if graph is not None else "")
            + f"); load {ld.load_s:.1f} s, "
            f"{ld.graphs_built} graphs in {ld.capture_s:.1f} s")


def _verify(run: Run, ld: Loaded) -> None:
    cfg, entry = run.cfg, run.part("verify")
    t0 = time.perf_counter()
    rows = verify_rows(ld.runner, cfg.verify_batches, cfg.verify_tokens, cfg.decode_context,
                       cfg.verify_reps, run.budget("verify"))
    for r in rows:
        r["graphs"], r["graphs_active"], r["attention"] = ld.graphs, ld.static, ld.attention
    entry.setdefault("rows", []).extend(rows)
    if len(rows) < len(cfg.verify_batches) * (len(cfg.verify_tokens) + 1):
        _partial(entry)
    ratio = ratio_8_over_1(rows)
    entry.setdefault("ratio_8_over_1_b1", {})[ld.mode] = ratio
    run.say(f"[verify] {ld.mode}: {len(rows)} points in "
            f"{time.perf_counter() - t0:.1f} s; time(8)/time(1) at batch 1 = "
            + (f"{ratio:.2f}" if ratio is not None else "n/a"))


def _partial(entry: dict) -> None:
    """Mark a part that left points out for its budget (an error stays an error)."""
    if entry["status"] == "ok":
        entry["status"] = "partial"


def drafters_part(run: Run, budget: Budget) -> None:
    """Each drafter shape decoding at each batch, graphs off and on."""
    cfg, entry = run.cfg, run.part("drafters")
    entry["rows"] = rows = []
    entry["shapes"] = [s.as_dict() for s in cfg.drafter_shapes]
    for shape in cfg.drafter_shapes:
        if budget.over():
            _partial(entry)
            break
        model = build_random(shape, run.device, run.dtype, max_len=cfg.max_model_len)
        for graphs in (False, True):
            rows += _drafter_rows(run, shape, model, graphs, budget)
        del model
        release_memory()


def _drafter_rows(run: Run, shape: Shape, model: torch.nn.Module, graphs: bool,
                  budget: Budget) -> list[dict]:
    cfg, rows = run.cfg, []
    ld = open_runner(model, run.runner_spec(cfg.drafter_kv_cache_memory), graphs)
    try:
        for b in cfg.drafter_batches:
            if budget.over():
                break
            step = decode_step_s(ld.runner, b, cfg.drafter_context, cfg.decode_tokens, cfg.reps)
            rows.append({"model": shape.name, "params": shape.params, **ld.info(), "batch": b,
                         "step_ms": 1e3 * step, "tok_s": b / step})
        if len(rows) < len(cfg.drafter_batches):
            _partial(run.part("drafters"))
    finally:
        ld.close()
    run.say(f"[drafters] {shape.name} graphs {'on ' if graphs else 'off'}: "
            + ", ".join(f"b={r['batch']} {r['step_ms']:.2f} ms" for r in rows)
            + f" (load {ld.load_s:.1f} s, {ld.graphs_built} graphs in {ld.capture_s:.1f} s)")
    return rows
