"""``spin bench learned``: why the warmed learned policy gains or loses against one fixed
configuration, step by step, on tuning prompts.

``spin bench policy`` says *whether* the learned policy keeps up with the best fixed
configuration; this says *why*. One deployment with the learned router and its step trace
(``router/step_trace.py``), warmed as ``spin bench policy`` warms its learned deployment
(``policy_goodput.warm_learned``: every drafter at k = 4 over ``requests`` tuning prompts,
greedy and sampled, then the timed prompts once with speculation off); then ``passes`` passes,
each of speculation off, the fixed configuration (``drafter:k``, early-stopping chains as the
grid's) and auto, one request at a time, over ``requests`` *other* prompts of the split, none
of them twice (``timed_workload``), each pass with sampling seeds of its own. Reported: the summed
request latencies per mode and pass, the ratios of their medians, and from the trace how each
mode's steps went: per (drafter, k) the steps, their median measured and predicted seconds and
mean accepted tokens, and per auto request its step sequence (``drafter[:5]`` k / accepted;
``-`` a plain step).

The default split is **tuning**: this is a tool for finding what to change, and what it is
used to change must not be timed on the evaluation prompts (README, Benchmarks).
"""

from __future__ import annotations

import statistics
import tempfile
from collections import defaultdict
from dataclasses import dataclass, replace
from pathlib import Path

from loadgen.workload import Request, build_workload

from ..router.step_trace import read_trace
from ..serve import Embedded, ServeConfig
from ..zoo.specs import FAMILY_DIR
from .policy_config import GREEDY, SAMPLED, PolicyBenchConfig, learned_router, run_requests
from .policy_goodput import model_and_lookup_drafters, warm_learned

MODES = ("off", "fixed", "auto")


@dataclass(frozen=True)
class LearnedBenchConfig:
    """What ``spin bench learned`` runs."""

    family_dir: Path = FAMILY_DIR
    drafter: str = "eagle"
    """The fixed configuration's drafter (a drafter service, a head or prompt lookup)."""
    k: int = 4
    """The fixed configuration's k (its chains stop early as the policy's do)."""
    sampled: bool = True
    """Time the sampled workload (temperature 0.8, top-p 0.95, seeded); False: greedy."""
    split: str = "tuning"
    """The held-out prompts' half the prompts come from (``zoo.corpus.prompt_split``)."""
    requests: int = 9
    """Prompts of the warm-up, and other prompts of each timed pass."""
    passes: int = 2
    """Passes over the three modes (each pass with its own sampling seeds)."""
    new_tokens: int = 64
    seed: int = 0
    """The warm-up's workload seed; the timed prompts are seed + 1's."""
    policy_config: dict | None = None
    """JSON overrides of the learned policy's settings."""
    trace: Path | None = None
    """Where the step trace goes (None: a temporary directory)."""


def run_learned(cfg: LearnedBenchConfig) -> dict:
    """Warm, run the passes, read the trace: the report (module doc)."""
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              seed=cfg.seed)
    sampling = SAMPLED if cfg.sampled else GREEDY
    trace = cfg.trace or Path(tempfile.mkdtemp(prefix="spin-bench-learned-")) / "trace.jsonl"
    trace.parent.mkdir(parents=True, exist_ok=True)
    trace.unlink(missing_ok=True)
    router = learned_router(cfg.policy_config)
    router = replace(router, scheduler=replace(router.scheduler, step_trace=str(trace)))
    timed = timed_workload(cfg)
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    spans: dict[str, list[tuple[int, int]]] = {m: [] for m in MODES}
    with Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                              log_dir=trace.parent / "logs")) as emb:
        drafters = model_and_lookup_drafters(emb)
        if cfg.drafter not in drafters:
            raise ValueError(f"no drafter {cfg.drafter!r} in this deployment; it has {drafters}")
        warm_learned(emb, timed, drafters, replace(bench, seed=cfg.seed), (GREEDY, SAMPLED))
        for p in range(cfg.passes):
            for mode, spec, k in (("off", "off", 0), ("fixed", cfg.drafter, cfg.k),
                                  ("auto", "auto", 0)):
                start = len(read_trace(trace))
                res, _ = run_requests(emb.endpoint, timed, spec, k, bench,
                                      f"{mode} ({p + 1}/{cfg.passes})", sampling=sampling,
                                      early_stop=mode == "fixed", rnd=p + 1)
                seconds[mode].append(sum(r.e2e_s for r in res))
                spans[mode].append((start, len(read_trace(trace))))
    return report(cfg, seconds, spans, read_trace(trace), str(trace))


def timed_workload(cfg: LearnedBenchConfig) -> list[Request]:
    """``cfg.requests`` requests of the split whose prompts differ from one another and from
    the warm-up's (``warm_learned`` draws ``build_workload(n, seed)`` of the tuning split): the
    first such of seed + 1's draws (a draw may repeat a prompt)."""
    warm = {w.prompt for w in build_workload(cfg.requests, seed=cfg.seed,
                                             family_dir=cfg.family_dir, split="tuning")}
    out: list[Request] = []
    for w in build_workload(4 * cfg.requests, seed=cfg.seed + 1, family_dir=cfg.family_dir,
                            split=cfg.split):
        if w.prompt not in warm and all(w.prompt != o.prompt for o in out):
            out.append(w)
    if len(out) < cfg.requests:
        raise ValueError(f"the {cfg.split} split has {len(out)} prompts apart from the "
                         f"warm-up's; ask for fewer requests")
    return out[:cfg.requests]


def report(cfg: LearnedBenchConfig, seconds: dict[str, list[float]],
           spans: dict[str, list[tuple[int, int]]], records: list[dict], trace: str) -> dict:
    """The report from each mode's summed latencies per pass, the trace records of each mode's
    passes (``spans``: [start, end) line numbers) and the records themselves."""
    med = {m: statistics.median(s) for m, s in seconds.items()}
    out: dict = {"fixed": f"{cfg.drafter}:k{cfg.k}", "split": cfg.split,
                 "workload": "sampled" if cfg.sampled else "greedy", "requests": cfg.requests,
                 "new_tokens": cfg.new_tokens, "passes": cfg.passes, "trace": trace,
                 "seconds": seconds,
                 "auto_over_fixed": med["fixed"] / med["auto"],
                 "auto_over_off": med["off"] / med["auto"],
                 "fixed_over_off": med["off"] / med["fixed"], "steps": {}}
    for mode in MODES:
        steps = [s for a, b in spans[mode] for s in records[a:b]]
        out["steps"][mode] = step_table(steps)
    out["auto_requests"] = [request_sequences(records[a:b]) for a, b in spans["auto"]]
    return out


def step_table(records: list[dict]) -> list[dict]:
    """Per (drafter, k) of the requests' steps (a request's first, its prefill, left out): the
    steps, median measured and predicted step milliseconds and mean accepted tokens."""
    rows: dict[tuple[str, int], list[tuple[float, int, float | None]]] = defaultdict(list)
    for s in records:
        predicted = (s.get("predicted") or {}).get("step_s")
        for rid, drafter, k, _, accepted, _, _, prefilled in s["requests"]:
            if not prefilled:
                rows[(drafter or "-", k)].append((s["step_s"], accepted, predicted))
    out = []
    for (drafter, k), xs in sorted(rows.items()):
        pred = [p for _, _, p in xs if p is not None]
        out.append({"drafter": drafter, "k": k, "steps": len(xs),
                    "step_ms": 1e3 * statistics.median(x[0] for x in xs),
                    "predicted_ms": 1e3 * statistics.median(pred) if pred else None,
                    "accepted": statistics.mean(x[1] for x in xs)})
    return out


def request_sequences(records: list[dict]) -> list[str]:
    """Each request's steps in order (a new request at its prefilling step), as ``drafter[:5]
    k/accepted`` words, ``-0/0`` for a plain step."""
    seqs: list[list[str]] = []
    for s in records:
        for rid, drafter, k, _, accepted, _, _, prefilled in s["requests"]:
            if prefilled or not seqs:
                seqs.append([])
            seqs[-1].append(f"{(drafter or '-')[:5]}{k}/{accepted}")
    return [" ".join(words) for words in seqs]


def summary(r: dict) -> str:
    """The report as text."""
    lines = [f"{r['workload']} workload, {r['requests']} {r['split']} prompts x "
             f"{r['new_tokens']} tokens, {r['passes']} passes; summed latency per pass:"]
    for mode in MODES:
        name = r["fixed"] if mode == "fixed" else mode
        lines.append(f"  {name:16s} " + "  ".join(f"{s:.2f} s" for s in r["seconds"][mode]))
    lines.append(f"medians: auto / {r['fixed']} {r['auto_over_fixed']:.3f}x, auto / off "
                 f"{r['auto_over_off']:.3f}x, {r['fixed']} / off {r['fixed_over_off']:.3f}x "
                 "(> 1: the first faster)")
    for mode in ("fixed", "auto"):
        lines.append(f"{r['fixed'] if mode == 'fixed' else mode} steps (drafter, k: steps, "
                     "median ms measured / predicted, mean accepted):")
        for row in r["steps"][mode]:
            pred = f"{row['predicted_ms']:.1f}" if row["predicted_ms"] is not None else "-"
            lines.append(f"  {row['drafter']:16s} k={row['k']:<2d} {row['steps']:5d}  "
                         f"{row['step_ms']:6.1f} / {pred:>6s} ms  {row['accepted']:.2f}")
    lines.append(f"the step trace: {r['trace']} (auto's requests, step by step, in the JSON)")
    return "\n".join(lines)
