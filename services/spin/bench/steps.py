"""``spin bench steps``: one decode step of each demo model, eager against the static-shape
steps of ``engine/step_graphs.py`` (bucketed eager, compiled; CUDA graphs on CUDA).

Per model and batch: prefill ``context`` tokens per request, then the median of ``reps`` decode
steps (one token per request, rolled back after each, so every step sees the same context) in
each mode, and the seconds the first step of a compiled bucket took (its compile). The numbers
behind the CPU defaults of ``--cuda-graphs`` (CUDA only) and ``--compile`` (off).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from ..engine.model_runner import ForwardItem, ModelRunner
from ..engine.step_graphs import GraphConfig, StepGraphs

MODES = ("eager", "bucketed", "compiled")
"""eager: exact shapes; bucketed: padded to a bucket, eager; compiled: bucketed and compiled
(on CUDA the bucketed modes replay captured graphs)."""


def _runner(path: Path, mode: str, device: str, max_seqs: int) -> ModelRunner:
    runner = ModelRunner(path, max_seqs=max_seqs, kv_cache_bytes=64 << 20, device=device,
                         compile=mode != "eager", cuda_graphs=mode != "eager")
    if mode == "bucketed":
        runner.graphs = StepGraphs(runner, GraphConfig(capture=runner.device.type == "cuda"))
    return runner


def _step_ms(runner: ModelRunner, batch: int, context: int, reps: int) -> tuple[float, float]:
    """(median ms of a decode step, seconds of the first one)."""
    seqs = [runner.cache.blocks.admit(f"s{i}") for i in range(batch)]
    runner.forward([ForwardItem(s, tuple(range(5, 5 + context))) for s in seqs], last_only=True)
    for s in seqs:
        runner.cache.commit(s, context)
    step = [ForwardItem(s, (7,)) for s in seqs]

    def once() -> float:
        t0 = time.perf_counter()
        runner.forward(step, last_only=True)
        if runner.device.type == "cuda":
            torch.cuda.synchronize(runner.device)
        for s in seqs:
            runner.cache.rollback(s, context)
        return time.perf_counter() - t0

    first = once()
    times = [once() for _ in range(reps)]
    for s in seqs:
        runner.cache.blocks.free(s)
    return statistics.median(times) * 1e3, first


def run_steps_bench(family_dir: Path, models: tuple[str, ...], batches: tuple[int, ...],
                    context: int = 100, reps: int = 30, device: str = "cpu",
                    modes: tuple[str, ...] = MODES) -> list[dict]:
    """A row per model, mode and batch: the median decode step and the first step's time."""
    rows = []
    for name in models:
        for mode in modes:
            runner = _runner(family_dir / name, mode, device, max(batches))
            for b in batches:
                ms, first = _step_ms(runner, b, context, reps)
                rows.append({"model": name, "mode": mode, "batch": b, "context": context,
                             "step_ms": ms, "first_s": first})
                print(f"{name:16s} {mode:9s} batch {b:3d}: {ms:7.2f} ms "
                      f"(first step {first:.1f} s)", flush=True)
    return rows
