"""``spin bench gpu``'s parts that run more than one forward: transformers' baselines, the demo
family end to end through ``spin serve``'s processes, and services vs in process.

They reuse the CPU benchmarks' code: ``engine_baselines.HFBaselines`` (transformers'
``generate`` and assisted generation), ``grid.run_cells`` (speculation auto vs off through the
router with ``loadgen``'s client, greedy outputs compared) and ``services.run_services_bench``,
with the device, dtype and KV cache budgets of this run.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from ..engine.drafter import ModelDrafter
from ..engine.engine import GenerationRequest, SpecEngine
from ..engine.memory import resolve_dtype
from ..engine.model_runner import RunnerConfig
from ..engine.verifier import Verifier
from ..router.config import RouterConfig, SchedulerConfig
from ..zoo.report import family_members
from .engine_baselines import AssistSetting, HFBaselines, HFMethod
from .gpu_run import Run
from .gpu_runner import release_memory
from .gpu_shapes import Budget, build_random, device_time, sync


CONSTANT4 = AssistSetting("constant-4", 4, "constant", 0.0)
"""transformers' assisted generation with 4 draft tokens per step (the engine's k = 4)."""
DEMO_K = 4


def baselines_part(run: Run, budget: Budget, model: PreTrainedModel) -> None:
    """transformers on the target shape (``generate``; assisted by the drafter shape that
    shares its vocabulary), then the demo family in process."""
    entry = run.part("baselines")
    entry["rows"] = rows = []
    _target_shape_baselines(run, budget, model, rows)
    if budget.over():
        if entry["status"] == "ok":
            entry["status"] = "partial"
        return
    entry["demo"] = demo_family(run, budget)


def _target_shape_baselines(run: Run, budget: Budget, model: PreTrainedModel,
                            rows: list[dict]) -> None:
    cfg, shape = run.cfg, run.cfg.target_shape
    n = cfg.baseline_tokens
    prompt = tuple(torch.randint(3, shape.vocab, (cfg.decode_context,),
                                 generator=torch.Generator().manual_seed(0)).tolist())
    hf = HFBaselines(model, {}, eos=model.config.eos_token_id)
    secs = device_time(lambda: hf.generate(HFMethod("generate"), prompt, n), run.device,
                       cfg.reps)
    rows.append({"model": shape.name, "method": "hf generate", "tokens": n, "tok_s": n / secs})
    run.say(f"[baselines] {shape.name} HF generate: {n / secs:.1f} tok/s")
    helper = next((s for s in cfg.drafter_shapes if s.vocab == shape.vocab), None)
    if helper is None or budget.over():
        return
    hf.drafts[helper.name] = build_random(helper, run.device, run.dtype, seed=1,
                                          max_len=cfg.max_model_len)
    method = HFMethod("assisted", draft=helper.name, assist=CONSTANT4)
    secs = device_time(lambda: hf.generate(method, prompt, n), run.device, 1)
    rows.append({"model": shape.name, "method": method.label, "tokens": n, "tok_s": n / secs,
                 "note": "random draft: the method's overhead, not its gain"})
    run.say(f"[baselines] {shape.name} {method.label}: {n / secs:.1f} tok/s (random draft)")
    hf.drafts.clear()
    release_memory()


def _timed_outputs(prompts: list[tuple[int, ...]], fn: Callable[[int, tuple[int, ...]], list[int]],
                   device: torch.device) -> tuple[list[list[int]], float]:
    """``fn(i, prompt)`` for every prompt: the outputs and the seconds of all of them."""
    sync(device)
    start = time.perf_counter()
    outs = [fn(i, p) for i, p in enumerate(prompts)]
    sync(device)
    return outs, time.perf_counter() - start


def demo_family(run: Run, budget: Budget) -> dict:
    """The demo target and its first draft model on the device, greedy at batch 1: HF generate,
    HF assisted (4 draft tokens per step), the engine alone and with the drafter at k = 4.
    ``spin_mismatches`` (speculation on vs off) must be 0; ``spin_vs_hf_mismatches`` compares
    our forward with transformers' (equal in float32; in half precision a near tie may round
    the other way)."""
    from .services import ServicesBenchConfig, prompt_ids

    cfg, fam = run.cfg, run.cfg.family_dir
    dtype = resolve_dtype(cfg.dtype, run.device, AutoConfig.from_pretrained(fam / "target").dtype)
    draft_name = family_members(fam)[0]
    models = {name: AutoModelForCausalLM.from_pretrained(fam / name, dtype=dtype)
              .to(run.device).eval() for name in ("target", draft_name)}
    hf = HFBaselines(models["target"], {draft_name: models[draft_name]},
                     eos=models["target"].config.eos_token_id)
    dtype_name = str(dtype).removeprefix("torch.")
    spec = RunnerConfig(device=str(run.device), dtype=dtype_name,
                        kv_cache_memory=cfg.service_kv_cache_memory, max_seqs=4,
                        cuda_graphs=True)
    runners = {name: spec.load(m) for name, m in models.items()}
    t0 = time.perf_counter()
    graphs = sum(r.capture_graphs(progress=False) for r in runners.values())
    capture_s = time.perf_counter() - t0
    engine = SpecEngine(Verifier(runners["target"]),
                        {draft_name: ModelDrafter(draft_name, runners[draft_name])})
    prompts = prompt_ids(ServicesBenchConfig(family_dir=fam, prompts=cfg.demo_prompts))
    n = cfg.demo_tokens
    assisted = HFMethod("assisted", draft=draft_name, assist=CONSTANT4)
    methods: dict[str, Callable[[int, tuple[int, ...]], list[int]]] = {
        "hf_generate": lambda i, p: hf.generate(HFMethod("generate"), p, n),
        "hf_assisted": lambda i, p: hf.generate(assisted, p, n),
        "spin_off": lambda i, p: engine.generate([GenerationRequest(
            f"off{i}", p, n, stop_at_eos=False)])[0].tokens,
        "spin_on": lambda i, p: engine.generate([GenerationRequest(
            f"on{i}", p, n, drafter=draft_name, k=DEMO_K, stop_at_eos=False)])[0].tokens}
    out: dict = {"draft": draft_name, "k": DEMO_K, "dtype": dtype_name, "prompts": len(prompts),
                 "new_tokens": n, "graphs_built": graphs, "capture_s": capture_s, "tok_s": {}}
    outputs = {}
    for name, fn in methods.items():
        if budget.over():
            out["status"] = "partial"
            break
        _timed_outputs(prompts[:1], lambda i, p: fn(i, p[:16]), run.device)  # warm-up
        outputs[name], secs = _timed_outputs(prompts, fn, run.device)
        out["tok_s"][name] = n * len(prompts) / secs
        run.say(f"[baselines] demo {name}: {out['tok_s'][name]:.1f} tok/s")
    out.update(_mismatches(outputs))
    return out


def _mismatches(outputs: dict[str, list[list[int]]]) -> dict:
    def count(a: str, b: str) -> int | None:
        if a not in outputs or b not in outputs:
            return None
        return sum(x != y for x, y in zip(outputs[a], outputs[b]))

    return {"spin_mismatches": count("spin_on", "spin_off"),
            "hf_assisted_mismatches": count("hf_assisted", "hf_generate"),
            "spin_vs_hf_mismatches": count("spin_off", "hf_generate")}


def _service_runner(run: Run) -> RunnerConfig:
    """What every service of the e2e and services parts runs with: this run's device, the
    checkpoint's dtype unless one was given, a small KV cache."""
    return RunnerConfig(device=str(run.device), dtype=run.cfg.dtype,
                        kv_cache_memory=run.cfg.service_kv_cache_memory)


def e2e_part(run: Run, budget: Budget) -> None:
    """The demo family through ``spin serve``'s processes (no Redis: statistics stay in the
    router), the learned policy: speculation auto vs off at each concurrency, greedy; two
    rounds in alternating order (off first, then auto first: what runs first pays for warm-up
    and leaves its prompts in the prefix cache). One deployment for both modes (the time allows
    one start), so without suffix decoding: it would draft auto's requests from off's outputs
    of the same prompts."""
    from ..serve import Embedded, ServeConfig
    from .grid import GridConfig, modes, run_cells

    cfg, entry = run.cfg, run.part("e2e")
    grid = GridConfig(family_dir=cfg.family_dir, quick=True, temperatures=(0.0,),
                      concurrencies=cfg.e2e_concurrency, prompt_sets=("short",), rounds=2)
    runner = _service_runner(run)
    emb = Embedded(ServeConfig(
        family_dir=cfg.family_dir, port=0, redis=False, runner=runner,
        drafter_kv_cache_memory=runner.kv_cache_memory,
        router=RouterConfig(policy="learned", http_port=None,  # no suffix decoding: the
                            scheduler=SchedulerConfig(suffix_decoding=False)),  # grid's doc
        log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-gpu-e2e-"))))
    t0 = time.perf_counter()
    emb.start(timeout_s=max(10.0, budget.left()))
    entry["start_s"] = time.perf_counter() - t0
    run.say(f"[e2e] services started in {entry['start_s']:.1f} s")
    try:
        cells = run_cells({label: emb.endpoint for label, _, _ in modes(grid)}, grid,
                          [("short", 0.0, c) for c in cfg.e2e_concurrency], progress=False)
    finally:
        emb.stop()
    entry["new_tokens"] = grid.new_tokens
    entry["cells"] = cells
    entry["greedy_mismatches"] = sum(c["greedy_mismatches"] or 0 for c in cells)
    for c in cells:
        m = c["modes"]
        run.say(f"[e2e] concurrency {c['concurrency']}: auto {m['auto']['tokens_per_s']:.1f} "
                f"tok/s (tau {m['auto']['tau']:.2f}), off {m['off']['tokens_per_s']:.1f} tok/s "
                f"= {c['auto_over_off']:.2f}x; greedy mismatches {c['greedy_mismatches']}")


def services_part(run: Run, budget: Budget) -> None:
    """``spin bench services`` on this device: in process vs through the gRPC services."""
    from .services import ServicesBenchConfig, run_services_bench

    cfg = run.cfg
    r = run_services_bench(ServicesBenchConfig(
        family_dir=cfg.family_dir, prompts=cfg.services_prompts, new_tokens=cfg.services_tokens,
        runner=_service_runner(run), start_timeout_s=max(10.0, budget.left())))
    run.part("services").update(r)
    t = r["tok_s"]
    run.say(f"[services] on: in process {t['inproc_on']:.1f} tok/s, services "
            f"{t['rpc_on']:.1f} tok/s ({r['ratio_services_vs_inprocess']:.2f}x); off: "
            f"{t['inproc_off']:.1f} vs {t['rpc_off']:.1f}; lossless {r['lossless']}")
