"""``spin bench grid``: speculation auto against off, over concurrency x temperature x prompts.

The promise checked here is the first one this project makes: speculation never makes serving
slower. Each mode has a deployment of its own (``spin serve``'s processes, the learned policy,
statistics in its own Redis), configured alike, which serves it in every cell; a cell is a prompt
set, a temperature and a concurrency, and in each the same requests run with speculation off,
auto, and (``--fixed NAME:K``) one fixed configuration, one mode after the other, each at that
concurrency with every request at once (``loadgen``'s closed loop), ``rounds`` times with the
order of the modes reversed every other pass. ``--variant LABEL=JSON`` adds auto with other
learned-policy settings as a mode of its own (its deployment configured with them): a constant's
candidates are compared side by side in one run, each against auto and off of the same passes.

A deployment per mode because the grid repeats itself where traffic does not: each mode sends
the same requests, every pass and cell sends them again. On one deployment the mode that runs
second would find the prompts the first one just prefilled in the prefix cache (one tuning run:
auto / off 1.19x in the passes where auto ran second, 0.98x where it ran first), and suffix
decoding would draft a request from the output the other mode gave it. For the same reason
suffix decoding is **off** here unless ``suffix_decoding`` (each pass would draft from the
last pass's outputs of the same prompts: a greedy request's whole output); ``spin bench
suffix`` measures it on a workload made for it. Prefix caching stays on (the default): each
deployment sees the prompts as often as the other.

Reported per cell: output tokens per second of each mode (all tokens over the wall time,
summed over passes) and per pass, mean end-to-end latency, auto / off (and per pass) and auto /
fixed, and for greedy cells the outputs that differ from off's first pass (lossless: must be 0).
``--repeat-off`` runs speculation off a second time as a mode of its own: its ratio to off is
the cell's noise floor (the same work, timed twice), against which auto / off is read.

Prompts: ``short`` are the demo family's held-out prompts, ``long`` a dataset of at least 200
tokens per prompt, by default ``benchmarks/datasets/unseen-long.jsonl`` (``spin bench dataset``:
text from outside the demo corpus). Both are timed on their **evaluation** half; ``--split
tuning`` times the other half, for runs that choose code or constants. Temperature 0.8 samples
with top-p 0.95, request ``i`` with seed ``seed + i`` in every mode.
"""

from __future__ import annotations

import contextlib
import re
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from loadgen.datasets import read_prompts
from loadgen.workload import Request, build_workload

from ..router.config import RouterConfig, SchedulerConfig
from ..serve import Embedded, ServeConfig
from ..zoo.specs import FAMILY_DIR
from .policy_config import PolicyBenchConfig, Sampling, run_requests
from .unseen import DEFAULT_OUT as UNSEEN


OFF_AGAIN = "off again"
"""The label of speculation off's second run in a cell (``GridConfig.repeat_off``)."""


@dataclass
class GridConfig:
    """What the grid runs."""

    family_dir: Path = FAMILY_DIR
    quick: bool = False
    """Fewer requests and tokens per cell (about a quarter of the time)."""
    concurrencies: tuple[int, ...] = (1, 8, 32, 64)
    """Requests in flight (each cell sends this many at once, then one per finished one)."""
    temperatures: tuple[float, ...] = (0.0, 0.8)
    """0 = greedy (lossless-checked); above, nucleus sampling with ``top_p``."""
    top_p: float = 0.95
    dataset: Path = UNSEEN
    """The long prompts (JSON Lines; rows with a ``split`` other than evaluation are left out)."""
    prompt_sets: tuple[str, ...] = ("short", "long")
    fixed: tuple[str, int] | None = None
    """A fixed configuration to compare too (drafter, k; its chain stops early as the policy's
    do), e.g. the best single one chosen on the tuning split."""
    repeat_off: bool = False
    """Also run speculation off a second time, as a mode of its own ("off again"): its ratio
    to off is what the machine's drift alone does to a cell's ratio."""
    split: Literal["evaluation", "tuning"] = "evaluation"
    """The half of both prompt sets that is timed: tuning runs (choosing code or constants) use
    ``tuning``, reported figures ``evaluation``."""
    rounds: int = 2
    """Passes over each cell's requests, the modes in turn, their order reversed every other
    pass (off, auto, auto, off, ...): a machine's speed drifts by 10% from one run to the next
    (the same plain steps, one after the other, on this project's 2-core CPU), and each mode
    sees the same drift. A mode's rate is its tokens over its wall time, summed over passes."""
    seed: int = 0
    policy_config: dict = field(default_factory=dict)
    """Overrides of the learned policy's settings (``learned_config``)."""
    trace: Path | None = None
    """Auto's router's step trace (``router/step_trace.py``; appended to; each other mode's
    beside it, its label added to the name: ``-off``, ``-off-again``); None: none."""
    suffix_decoding: bool = False
    """Offer suffix decoding in the deployments (module doc: off, repeated prompts flatter it)."""
    variants: dict[str, dict] = field(default_factory=dict)
    """Auto with other learned-policy settings, each a mode of its own: label -> overrides,
    applied over ``policy_config`` (how a constant's candidates are compared on the tuning
    split, in one run); a variant's ``DEPLOYMENT`` key changes what its deployment serves."""

    @property
    def new_tokens(self) -> int:
        return 32 if self.quick else 64

    def requests(self, concurrency: int) -> int:
        """Requests of a cell: two rounds of the concurrency, at least 8 (16)."""
        return max(concurrency, 8) if self.quick else max(2 * concurrency, 16)


def grid_rows(cfg: GridConfig, prompts: str, n: int) -> list[Request]:
    """``n`` requests of the prompt set ``prompts`` (``short`` or ``long``), ``cfg.split``'s."""
    if prompts == "short":
        return build_workload(n, seed=cfg.seed, family_dir=cfg.family_dir, split=cfg.split)
    return build_workload(n, seed=cfg.seed, rows=read_prompts(cfg.dataset), split=cfg.split)


def modes(cfg: GridConfig) -> list[tuple[str, str, int]]:
    """The modes a cell runs: (label, speculation, k)."""
    out = [("off", "off", 0), ("auto", "auto", 0)]
    if cfg.fixed is not None:
        out.append((f"{cfg.fixed[0]}:k{cfg.fixed[1]}", cfg.fixed[0], cfg.fixed[1]))
    out += [(label, "auto", 0) for label in cfg.variants]
    if cfg.repeat_off:
        out.append((OFF_AGAIN, "off", 0))
    return out


DEPLOYMENT = "deployment"
"""A variant's key for what its deployment serves rather than how its policy decides:
``{"colocate": [...]}`` (``ServeConfig.colocate``; e.g. ``["all"]``)."""


def policy_config(cfg: GridConfig, label: str) -> dict:
    """The learned policy's overrides of mode ``label``'s deployment: ``cfg.policy_config``,
    and a variant's own over it (nested settings merged key by key)."""
    own = {k: v for k, v in cfg.variants.get(label, {}).items() if k != DEPLOYMENT}
    return merged(cfg.policy_config, own)


def deployment_options(variant: dict) -> dict:
    """A variant's ``DEPLOYMENT`` options; ValueError for one the grid does not know."""
    options = variant.get(DEPLOYMENT, {})
    if not isinstance(options, dict) or set(options) - {"colocate"}:
        raise ValueError(f'"{DEPLOYMENT}" takes {{"colocate": [NAME, ...]}}, got {options!r}')
    if not all(isinstance(n, str) for n in options.get("colocate", [])):
        raise ValueError(f'"{DEPLOYMENT}": colocate wants drafter names, got {options}')
    return options


def merged(base: dict, over: dict) -> dict:
    """``over`` applied to ``base`` key by key (nested settings merged; neither mutated)."""
    out = dict(base)
    for key, value in over.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = merged(out[key], value) if both else value
    return out


def _cell(endpoints: Mapping[str, str], cfg: GridConfig, bench: PolicyBenchConfig,
          prompts: str, temperature: float, concurrency: int) -> dict:
    """One cell: each mode's tokens/s and mean latency, the ratios, greedy mismatches."""
    reqs = grid_rows(cfg, prompts, cfg.requests(concurrency))
    sampling = (Sampling("greedy") if temperature == 0 else
                Sampling("sampled", temperature=temperature, top_p=cfg.top_p))
    modes_ = modes(cfg)
    cell: dict = {"prompts": prompts, "temperature": temperature, "concurrency": concurrency,
                  "requests": len(reqs), "rounds": cfg.rounds, "modes": {}}
    outputs: dict[str, list[list[list[int]]]] = {label: [] for label, _, _ in modes_}
    # label -> per pass: (tokens, wall seconds, each request's latency, steps)
    runs: dict[str, list[tuple[int, float, list[float], int]]] = {m[0]: [] for m in modes_}
    for rnd in range(cfg.rounds):
        for label, spec, k in (modes_ if rnd % 2 == 0 else modes_[::-1]):
            desc = f"{prompts} t={temperature} c={concurrency} {label} ({rnd + 1}/{cfg.rounds})"
            res, wall = run_requests(endpoints[label], reqs, spec, k, bench, desc,
                                     concurrency=concurrency, progress=False, sampling=sampling,
                                     early_stop=k > 0)
            outputs[label].append([r.token_ids for r in res])
            runs[label].append((sum(len(r.token_ids) for r in res), wall,
                                [r.e2e_s for r in res], sum(r.speculation.steps for r in res)))
    for label, rs in runs.items():
        tokens, wall, steps = (sum(r[0] for r in rs), sum(r[1] for r in rs),
                               sum(r[3] for r in rs))
        cell["modes"][label] = {"tokens_per_s": tokens / wall,
                                "mean_latency_s": statistics.mean(x for r in rs for x in r[2]),
                                "tau": tokens / steps if steps else 0.0,
                                "tokens_per_s_by_round": [r[0] / r[1] for r in rs]}
    m = cell["modes"]
    cell["auto_over_off"] = m["auto"]["tokens_per_s"] / m["off"]["tokens_per_s"]
    cell["auto_over_off_by_round"] = [a / o for a, o in zip(
        m["auto"]["tokens_per_s_by_round"], m["off"]["tokens_per_s_by_round"])]
    if cfg.fixed is not None:
        fixed = m[modes_[2][0]]["tokens_per_s"]
        cell["auto_over_fixed"] = m["auto"]["tokens_per_s"] / fixed
    if cfg.repeat_off:
        cell["off_again_over_off"] = m[OFF_AGAIN]["tokens_per_s"] / m["off"]["tokens_per_s"]
    if cfg.variants:
        cell["variants"] = {
            label: {"over_auto": m[label]["tokens_per_s"] / m["auto"]["tokens_per_s"],
                    "over_off": m[label]["tokens_per_s"] / m["off"]["tokens_per_s"]}
            for label in cfg.variants}
    cell["auto_latency_not_worse"] = m["auto"]["mean_latency_s"] <= m["off"]["mean_latency_s"]
    reference = outputs["off"][0]  # every greedy output of every pass and mode against it
    cell["greedy_mismatches"] = (sum(a != b for label in outputs for run in outputs[label]
                                     for a, b in zip(run, reference))
                                 if temperature == 0 else None)
    return cell


def run_cells(endpoints: Mapping[str, str], cfg: GridConfig,
              grid: list[tuple[str, float, int]], progress: bool = True) -> list[dict]:
    """A warm-up request on each deployment, then each cell (prompt set, temperature,
    concurrency) of ``grid``, each mode on its deployment (``endpoints``: label -> host:port;
    ``spin bench gpu``'s end-to-end part gives every mode one)."""
    bench = PolicyBenchConfig(family_dir=cfg.family_dir, new_tokens=cfg.new_tokens,
                              seed=cfg.seed)
    warm_up(endpoints, cfg, bench)
    return [_cell(endpoints, cfg, bench, p, t, c)
            for p, t, c in tqdm(grid, desc="grid", unit="cell", disable=not progress)]


def warm_up(endpoints: Mapping[str, str], cfg: GridConfig, bench: PolicyBenchConfig) -> None:
    """One request on each deployment: the models' first steps load (not a timed prompt)."""
    for endpoint in dict.fromkeys(endpoints.values()):
        run_requests(endpoint, grid_rows(cfg, "short", 1), "off", 0, bench, "warm-up",
                     progress=False)


def deployments(cfg: GridConfig, labels: list[str], stack: contextlib.ExitStack
                ) -> dict[str, str]:
    """A deployment per mode (``labels``), alike but for the step trace, entered on
    ``stack``: label -> its endpoint."""
    endpoints = {}
    for label in tqdm(labels, desc="deployments", unit="mode"):
        router = RouterConfig(policy="learned", policy_config=policy_config(cfg, label),
                              scheduler=SchedulerConfig(step_trace=_trace(cfg, label),
                                                        suffix_decoding=cfg.suffix_decoding))
        colocate = deployment_options(cfg.variants.get(label, {})).get("colocate", ())
        emb = stack.enter_context(Embedded(ServeConfig(
            family_dir=cfg.family_dir, port=0, router=router, colocate=tuple(colocate),
            log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-grid-")))))
        endpoints[label] = emb.endpoint
    return endpoints


def _trace(cfg: GridConfig, label: str) -> str | None:
    """Auto's trace at ``cfg.trace``; every other mode's beside it, its label added to the name
    (``-off``, ``-off-again``, ``-draft-code-k4``): off again's steps against off's are the
    noise floor of a step-by-step comparison."""
    if cfg.trace is None:
        return None
    if label == "auto":
        return str(cfg.trace)
    tag = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
    return str(cfg.trace.with_name(f"{cfg.trace.stem}-{tag}{cfg.trace.suffix}"))


def run_grid(cfg: GridConfig) -> dict:
    """Every cell, each mode on a deployment of its own; the report (``cells`` and a
    summary)."""
    grid = [(p, t, c) for p in cfg.prompt_sets for t in cfg.temperatures
            for c in cfg.concurrencies]
    with contextlib.ExitStack() as stack:
        endpoints = deployments(cfg, [label for label, _, _ in modes(cfg)], stack)
        cells = run_cells(endpoints, cfg, grid)
    ratios = [c["auto_over_off"] for c in cells]
    return {"config": {"quick": cfg.quick, "new_tokens": cfg.new_tokens,
                       "concurrencies": list(cfg.concurrencies),
                       "temperatures": list(cfg.temperatures), "dataset": str(cfg.dataset),
                       "fixed": list(cfg.fixed) if cfg.fixed else None,
                       "repeat_off": cfg.repeat_off,
                       "policy_config": cfg.policy_config, "split": cfg.split,
                       "rounds": cfg.rounds, "suffix_decoding": cfg.suffix_decoding,
                       "variants": cfg.variants, "deployments": "one per mode"},
            "cells": cells, "min_auto_over_off": min(ratios),
            "median_auto_over_off": statistics.median(ratios),
            "greedy_mismatches": sum(c["greedy_mismatches"] or 0 for c in cells),
            **({"off_again_over_off_range": [min(c["off_again_over_off"] for c in cells),
                                             max(c["off_again_over_off"] for c in cells)]}
               if cfg.repeat_off else {}),
            **({"variants": _variant_summary(cfg, cells)} if cfg.variants else {})}


def _variant_summary(cfg: GridConfig, cells: list[dict]) -> dict:
    """Each variant's median and minimum over the cells, against auto and against off."""
    out = {}
    for label in cfg.variants:
        auto = [c["variants"][label]["over_auto"] for c in cells]
        off = [c["variants"][label]["over_off"] for c in cells]
        out[label] = {"median_over_auto": statistics.median(auto), "min_over_auto": min(auto),
                      "median_over_off": statistics.median(off), "min_over_off": min(off)}
    return out


def table(report: dict) -> str:
    """The grid as a Markdown table."""
    fixed = report["config"]["fixed"]
    head = "| prompts | temp | conc | off tok/s | auto tok/s | auto / off (each pass) |"
    head += " fixed tok/s | auto / fixed |" if fixed else ""
    head += " mean latency auto / off |"
    variants = list(report["config"].get("variants") or ())
    head += "".join(f" {label} / auto |" for label in variants)
    head += " off again / off |" if report["config"].get("repeat_off") else ""
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for c in report["cells"]:
        m = c["modes"]
        row = (f"| {c['prompts']} | {c['temperature']:g} | {c['concurrency']} | "
               f"{m['off']['tokens_per_s']:.1f} | {m['auto']['tokens_per_s']:.1f} | "
               f"{c['auto_over_off']:.3f}x ({_passes(c)}) |")
        if fixed:
            label = f"{fixed[0]}:k{fixed[1]}"
            row += f" {m[label]['tokens_per_s']:.1f} | {c['auto_over_fixed']:.3f}x |"
        row += (f" {m['auto']['mean_latency_s']:.2f} / {m['off']['mean_latency_s']:.2f} s |")
        row += "".join(f" {c['variants'][label]['over_auto']:.3f}x |" for label in variants)
        if "off_again_over_off" in c:
            row += f" {c['off_again_over_off']:.3f}x |"
        lines.append(row)
    return "\n".join(lines)


def _passes(cell: dict) -> str:
    return ", ".join(f"{r:.2f}" for r in cell.get("auto_over_off_by_round", ()))


def plot_grid(report: dict, path: Path) -> None:
    """auto / off per cell, one bar group per prompt set and temperature."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = report["cells"]
    groups = sorted({(c["prompts"], c["temperature"]) for c in cells})
    concs = sorted({c["concurrency"] for c in cells})
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(groups)
    for i, (p, t) in enumerate(groups):
        ys = [next(c["auto_over_off"] for c in cells if (c["prompts"], c["temperature"],
                                                         c["concurrency"]) == (p, t, n))
              for n in concs]
        ax.bar([j + i * width for j in range(len(concs))], ys, width, label=f"{p}, t={t:g}")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(concs))], [str(n) for n in concs])
    ax.set_xlabel("concurrency")
    ax.set_ylabel("throughput, auto / off")
    ax.set_title("SPIN serving: speculation auto against off (demo family)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
