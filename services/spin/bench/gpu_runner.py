"""``spin bench gpu``'s measurements through the project's own forward (``ModelRunner``):
decode steps of a batch, verification forwards of chains and trees, each timed to the end of
its device work (``gpu_shapes.device_time``: synchronised, a warm-up call first, medians).

A decode step is what serving runs: one new token per request, the next token read back to the
host (``argmax().tolist()``), the cache committed; after each timed run the requests are rolled
back to their prompt, so every repetition decodes from the same context. A verification point
is one forward of ``n`` new tokens per request after ``context`` committed ones (nothing
committed: each repetition rewrites the same positions, as ``timing/measure.py`` does).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from ..engine.model_runner import ForwardItem, ModelRunner, RunnerConfig
from .gpu_shapes import Budget, device_time

TREE16 = (-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6)
"""A 16-node tree: two first-level nodes, each node with two children, four levels."""


@dataclass(frozen=True)
class RunnerSpec:
    """How a benchmark runner is built from a model."""

    device: str
    """cpu, cuda or cuda:N."""
    dtype: str
    """float32, bfloat16 or float16 (the model's own)."""
    kv_cache_memory: int
    """KV cache bytes."""
    max_model_len: int
    """Longest context; it also bounds the runner's key buckets."""
    max_seqs: int = 64
    """Requests at once (the largest batch measured)."""


@dataclass
class Loaded:
    """A runner and what building it cost."""

    runner: ModelRunner
    """The runner (dropped by ``close``)."""
    graphs: bool
    """CUDA graphs asked for."""
    load_s: float
    """Building the runner from the model (weights fused, KV cache allocated)."""
    capture_s: float
    """``capture_graphs``: every bucket's graph captured (0 without graphs)."""
    graphs_built: int
    """Graphs (static steps) ``capture_graphs`` built."""
    static: bool
    """Whether the runner runs bucketed static-shape steps at all (on the CPU it does not)."""
    attention: str = "sdpa"
    """The runner's attention (``RunnerConfig.attention``)."""

    def info(self) -> dict:
        return {"graphs": self.graphs, "graphs_active": self.static, "load_s": self.load_s,
                "capture_s": self.capture_s, "graphs_built": self.graphs_built,
                "attention": self.attention}

    @property
    def mode(self) -> str:
        """eager, graphs or graphs+flex (the verify part's variants)."""
        name = "graphs" if self.graphs else "eager"
        return name if self.attention == "sdpa" else f"{name}+{self.attention}"

    def close(self) -> None:
        """Drop the runner (callers may still hold this object) and free its memory."""
        self.__dict__.pop("runner", None)
        release_memory()


def open_runner(model: PreTrainedModel, spec: RunnerSpec, graphs: bool,
                attention: str = "sdpa") -> Loaded:
    """A runner of ``model`` with CUDA graphs on or off, every graph captured (``close`` gives
    its device memory back: the fused weights and KV cache; the model itself stays). With flex
    attention the graphs are captured at first use instead: each capture's warm-up compiles
    flex for its shapes, and only the buckets measured are worth that."""
    t0 = time.perf_counter()
    runner = RunnerConfig(device=spec.device, dtype=spec.dtype,
                          kv_cache_memory=spec.kv_cache_memory,
                          max_model_len=spec.max_model_len, max_seqs=spec.max_seqs,
                          cuda_graphs=graphs, compile=False, attention=attention).load(model)
    t1 = time.perf_counter()
    built = runner.capture_graphs(progress=False) if graphs and attention == "sdpa" else 0
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return Loaded(runner, graphs, t1 - t0, time.perf_counter() - t1, built,
                  getattr(runner, "graphs", None) is not None, attention)


def release_memory() -> None:
    """Collect garbage (a runner and its step graphs refer to each other) and give cached CUDA
    memory back, so the next model or process finds it free."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _prompts(batch: int, context: int, vocab: int, seed: int = 0) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(row) for row in torch.randint(3, vocab, (batch, context), generator=g).tolist()]


@contextlib.contextmanager
def prefilled(runner: ModelRunner, batch: int, context: int) -> Iterator[tuple[list[int], list[int]]]:
    """``batch`` requests with ``context`` committed prompt tokens: (their sequences, each one's
    next token); freed after."""
    blocks = runner.cache.blocks
    seqs = [blocks.admit(f"bench-gpu-{i}") for i in range(batch)]
    try:
        prompts = _prompts(batch, context, runner.vocab_limit)
        first: list[int] = []
        for lo in range(0, batch, 16):  # at most 16 prompts per forward: bounded activations
            part = list(zip(seqs[lo:lo + 16], prompts[lo:lo + 16]))
            with torch.inference_mode():
                logits = runner.forward([ForwardItem(s, p) for s, p in part], last_only=True)
            first += logits[:, 0].argmax(-1).tolist()                                # [b]
            for s, _ in part:
                runner.cache.commit(s, context)
        yield seqs, first
    finally:
        for s in seqs:
            blocks.free(s)


def decode_step_s(runner: ModelRunner, batch: int, context: int, steps: int, reps: int) -> float:
    """Median seconds of one decode step of ``batch`` requests after ``context`` tokens."""
    with prefilled(runner, batch, context) as (seqs, first):
        @torch.inference_mode()
        def run() -> None:
            toks = first
            for i in range(steps):
                out = runner.forward([ForwardItem(s, (t,)) for s, t in zip(seqs, toks)],
                                     last_only=True)                               # [B, 1, V']
                toks = out[:, 0].argmax(-1).tolist()  # the host reads each step's tokens
                for s in seqs:
                    runner.cache.commit(s, context + i + 1)
            for s in seqs:
                runner.cache.rollback(s, context)

        return device_time(run, runner.device, reps) / steps


def graph_replay_s(runner: ModelRunner, batch: int, keys: int, reps: int,
                   replays: int = 32) -> float | None:
    """Median seconds of one replay of the captured graph of a ``batch``-request decode step
    with ``keys`` keys, replays queued back to back (the device's time alone: a decode step's
    wall time less this is what the host and the work outside the graph cost); None without
    that graph. Replays its last step's inputs again: in a bench, after ``decode_step_s``."""
    g = runner.graphs
    step = g.steps.get(g.bucket([1] * batch, keys)) if g is not None and g.capture else None
    if step is None:
        return None

    def run() -> None:
        for _ in range(replays):
            step.run()

    return device_time(run, runner.device, reps) / replays


def verify_shapes(tokens: tuple[int, ...], tree: bool) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """(label, new tokens, parents) of each verification point: chains of ``tokens``, then the
    16-node tree."""
    out: list[tuple[str, int, tuple[int, ...] | None]] = [("chain", n, None) for n in tokens]
    return out + ([("tree", len(TREE16), TREE16)] if tree else [])


def verify_rows(runner: ModelRunner, batches: tuple[int, ...], tokens: tuple[int, ...],
                context: int, reps: int, budget: Budget) -> list[dict]:
    """Milliseconds of one verification forward at each batch x shape (points past the budget
    are left out)."""
    rows = []
    for b in batches:
        if budget.over():
            break
        with prefilled(runner, b, context) as (seqs, first):
            for label, n, parents in verify_shapes(tokens, tree=True):
                if budget.over():
                    break
                items = [ForwardItem(s, (t,) + tuple(range(5, 4 + n)), parents)
                         for s, t in zip(seqs, first)]
                with torch.inference_mode():
                    secs = device_time(lambda: runner.forward(items), runner.device, reps)
                rows.append({"batch": b, "shape": label, "tokens": n, "ms": 1e3 * secs})
    return rows


def ratio_8_over_1(rows: list[dict], batch: int = 1) -> float | None:
    """time(8-token chain) / time(1 token) at ``batch`` in ``rows`` (None when missing)."""
    t = {r["tokens"]: r["ms"] for r in rows if r["batch"] == batch and r["shape"] == "chain"}
    return t[8] / t[1] if 8 in t and 1 in t else None
