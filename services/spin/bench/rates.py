"""``spin bench rates``: speculation auto against off under open-loop load, from light load to
twice the capacity of off.

The grid (``grid.py``) keeps a fixed number of requests in flight; real traffic arrives on its
own clock, and past saturation a queue builds. Here, per prompt set and temperature, each mode
on a deployment of its own (as in the grid, for the same reasons: the prefix cache and suffix
decoding would let the mode that runs second find the first one's work), first the **capacity**
of speculation off: ``requests`` sent at once (the router batches them), requests per second =
requests / wall seconds (every mode's deployment runs that batch, so all start with the prompts
prefilled alike; auto's rate is reported beside off's). Then Poisson arrivals at ``fractions``
of that capacity (to 2x: past 1x off's queue grows); at each rate the same requests on the same
arrival times with each mode in turn, their order reversed every other rate.

Reported per rate: each mode's mean and p99 end-to-end latency (queueing included) and output
tokens per second, auto / off mean latency (at most 1: speculation did not make requests wait
longer: the bar is mean latency <= off at every swept rate up to 2x the capacity of off), and
for greedy sets the outputs that differ from off's (lossless: must be 0). ``repeat_off`` adds
off a second time (on a deployment of its own): its ratio to off is the noise floor.
"""

from __future__ import annotations

import contextlib
import statistics
from dataclasses import dataclass, field

from tqdm import tqdm

from loadgen.workload import Request, arrival_times

from .grid import OFF_AGAIN, GridConfig, deployments, grid_rows, warm_up
from .policy_config import PolicyBenchConfig, Sampling, run_requests
from .policy_sweep import p99


@dataclass
class RatesConfig:
    """What the sweep runs: the grid's prompt sets, temperatures, split and deployments
    (``grid``: its concurrencies and rounds are not used), at ``fractions`` of off's capacity."""

    grid: GridConfig = field(default_factory=GridConfig)
    fractions: tuple[float, ...] = (0.25, 0.5, 1.0, 1.5, 2.0)
    """Arrival rates as fractions of speculation off's batched capacity."""
    requests: int = 32
    """Requests per rate (and in the capacity run)."""


def _modes(cfg: RatesConfig) -> list[tuple[str, str]]:
    """(label, speculation) of each mode."""
    return [("off", "off"), ("auto", "auto")] + ([(OFF_AGAIN, "off")] if cfg.grid.repeat_off
                                                  else [])


def _sweep(endpoints: dict[str, str], cfg: RatesConfig, bench: PolicyBenchConfig,
           prompts: str, temperature: float, bar: tqdm | None = None) -> dict:
    """One prompt set at one temperature: off's capacity, then every rate (``bar`` advanced
    by one each)."""
    rows = grid_rows(cfg.grid, prompts, cfg.requests)
    sampling = (Sampling("greedy") if temperature == 0 else
                Sampling("sampled", temperature=temperature, top_p=cfg.grid.top_p))
    label = f"{prompts} t={temperature}"
    modes = _modes(cfg)
    batched: dict[str, float] = {}  # every deployment prefills the prompts once, as off does
    for name, spec in modes:
        res, wall = run_requests(endpoints[name], rows, spec, 0, bench,
                                 f"{label} {name} all at once", concurrency=len(rows),
                                 progress=False, sampling=sampling)
        batched[name] = len(rows) / wall
        if name == "off":
            reference = [r.token_ids for r in res]
    capacity = batched["off"]
    out: dict = {"prompts": prompts, "temperature": temperature, "requests": len(rows),
                 "capacity_rps": capacity, "all_at_once_rps": batched, "rates": []}
    for i, frac in enumerate(cfg.fractions):
        times = arrival_times(len(rows), frac * capacity, 1.0, cfg.grid.seed + i)
        reqs = [Request(w.index, w.domain, w.prompt, t) for w, t in zip(rows, times)]
        point: dict = {"load_fraction": frac, "rate_rps": frac * capacity, "modes": {}}
        mismatches = 0
        for name, spec in (modes if i % 2 == 0 else modes[::-1]):
            res, wall = run_requests(endpoints[name], reqs, spec, 0, bench,
                                     f"{label} {name} @{frac:g}x", concurrency=None,
                                     progress=False, sampling=sampling)
            lat = [r.e2e_s for r in res]
            point["modes"][name] = {"mean_latency_s": statistics.mean(lat),
                                    "p99_latency_s": p99(lat),
                                    "tokens_per_s": sum(len(r.token_ids) for r in res) / wall}
            mismatches += sum(r.token_ids != ref for r, ref in zip(res, reference))
        m = point["modes"]
        point["auto_over_off_latency"] = m["auto"]["mean_latency_s"] / m["off"]["mean_latency_s"]
        if cfg.grid.repeat_off:
            point["off_again_over_off_latency"] = (m[OFF_AGAIN]["mean_latency_s"]
                                                   / m["off"]["mean_latency_s"])
        point["greedy_mismatches"] = mismatches if temperature == 0 else None
        out["rates"].append(point)
        if bar is not None:
            bar.update()
    return out


def run_rates(cfg: RatesConfig, progress: bool = True) -> dict:
    """Every prompt set and temperature, each mode on a deployment of its own; the report."""
    g = cfg.grid
    bench = PolicyBenchConfig(family_dir=g.family_dir, new_tokens=g.new_tokens, seed=g.seed)
    sets = [(p, t) for p in g.prompt_sets for t in g.temperatures]
    with contextlib.ExitStack() as stack:
        endpoints = deployments(g, [m for m, _ in _modes(cfg)], stack)
        warm_up(endpoints, g, bench)
        with tqdm(total=len(sets) * len(cfg.fractions), desc="rate sweeps", unit="rate",
                  disable=not progress) as bar:
            sweeps = [_sweep(endpoints, cfg, bench, p, t, bar) for p, t in sets]
    ratios = [pt["auto_over_off_latency"] for s in sweeps for pt in s["rates"]]
    return {"config": {"fractions": list(cfg.fractions), "requests": cfg.requests,
                       "new_tokens": g.new_tokens, "temperatures": list(g.temperatures),
                       "prompt_sets": list(g.prompt_sets), "dataset": str(g.dataset),
                       "split": g.split, "repeat_off": g.repeat_off, "seed": g.seed,
                       "policy_config": g.policy_config, "suffix_decoding": g.suffix_decoding,
                       "deployments": "one per mode"},
            "sweeps": sweeps, "max_auto_over_off_latency": max(ratios),
            "median_auto_over_off_latency": statistics.median(ratios),
            "greedy_mismatches": sum(pt["greedy_mismatches"] or 0 for s in sweeps
                                     for pt in s["rates"])}


def table(report: dict) -> str:
    """One row per prompt set, temperature and rate."""
    again = report["config"]["repeat_off"]
    lines = ["| prompts | temp | rate (x cap) | req/s | off mean s | auto mean s | auto / off "
             "latency |" + (" off again / off |" if again else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if again else "")]
    for s in report["sweeps"]:
        for pt in s["rates"]:
            m = pt["modes"]
            lines.append(f"| {s['prompts']} | {s['temperature']:g} | {pt['load_fraction']:g} | "
                         f"{pt['rate_rps']:.2f} | {m['off']['mean_latency_s']:.2f} | "
                         f"{m['auto']['mean_latency_s']:.2f} | "
                         f"{pt['auto_over_off_latency']:.3f}x |"
                         + (f" {pt['off_again_over_off_latency']:.3f}x |" if again else ""))
    return "\n".join(lines)
