"""``spin bench policy``, load section: auto against off from light load to twice saturation.

First the **batched capacity** of speculation off: ``sweep_requests`` (two full batches) sent at
once, requests per second = requests / wall seconds, with the router batching as it does in
serving. Then Poisson arrivals at fractions of that capacity, up to 2x (past saturation a queue
builds); at each rate the same requests with speculation auto and off, greedy, every output
compared with off's (lossless). Mean and p99 end-to-end latency per mode and rate, and a PNG.

``spin bench sweep`` runs this section alone, on the **tuning** split by default and with the
learned policy's settings overridden (``--policy-config``), to tune the policy under load without
looking at the prompts ``spin bench policy`` times.
"""

from __future__ import annotations

import math
import statistics
import tempfile
from pathlib import Path

from tqdm import tqdm

from loadgen.workload import Request, arrival_times, build_workload

from ..serve import Embedded, ServeConfig
from ..zoo.corpus import PromptSplit
from .policy_config import PolicyBenchConfig, learned_router, run_requests

MODES = ("auto", "off")


def p99(values: list[float]) -> float:
    """The nearest-rank 99th percentile."""
    v = sorted(values)
    return v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]


def load_sweep(emb: Embedded, cfg: PolicyBenchConfig, split: PromptSplit = "evaluation",
               fractions: tuple[float, ...] | None = None) -> tuple[dict, int]:
    """The section's report and its lossless mismatches: ``split``'s prompts at ``fractions``
    of the capacity (default ``cfg.load_fractions``)."""
    rows = build_workload(cfg.sweep_requests, seed=cfg.seed + 1, family_dir=cfg.family_dir,
                          split=split)
    res, wall = run_requests(emb.endpoint, rows, "off", 0, cfg, "capacity (off, all at once)",
                             concurrency=len(rows))
    reference = [r.token_ids for r in res]
    capacity = len(rows) / wall
    mismatches = 0
    out: list[dict] = []
    for frac in tqdm(fractions or cfg.load_fractions, desc="load sweep", unit="rate"):
        rate = frac * capacity
        times = arrival_times(len(rows), rate, 1.0, cfg.seed)
        reqs = [Request(w.index, w.domain, w.prompt, t) for w, t in zip(rows, times)]
        row: dict = {"rate": rate, "load_fraction": frac}
        for mode in MODES:
            res, wall = run_requests(emb.endpoint, reqs, mode, 0, cfg, f"{mode} @{rate:.2f}/s",
                                     concurrency=None)
            mismatches += sum(r.token_ids != ref for r, ref in zip(res, reference))
            lat = [r.e2e_s for r in res]
            row[f"{mode}_mean_latency_s"] = statistics.mean(lat)
            row[f"{mode}_p99_latency_s"] = p99(lat)
            row[f"{mode}_tokens_per_s"] = sum(len(r.token_ids) for r in res) / wall
            slow = max(res, key=lambda r: r.e2e_s)  # which request the tail is
            row[f"{mode}_slowest"] = {"index": slow.index, "domain": rows[slow.index].domain,
                                      "arrival_s": reqs[slow.index].arrival_s,
                                      "ttft_s": slow.ttft_s, "steps": slow.speculation.steps,
                                      "drafters": {d: c.steps for d, c in
                                                   slow.speculation.drafters.items()}}
        row["auto_not_worse"] = (row["auto_mean_latency_s"] <= row["off_mean_latency_s"]
                                 and row["auto_p99_latency_s"] <= row["off_p99_latency_s"])
        out.append(row)
    return {"capacity_req_s": capacity, "capacity_tokens_s": capacity * cfg.new_tokens,
            "requests_per_rate": len(rows), "split": split, "rates": out}, mismatches


def run_sweep_bench(cfg: PolicyBenchConfig, split: PromptSplit = "tuning",
                    fractions: tuple[float, ...] | None = None,
                    policy_config: dict | None = None) -> dict:
    """``spin bench sweep``: the load section alone on a fresh deployment whose learned policy
    has ``policy_config``'s overrides; its report plus ``lossless_mismatches``."""
    router = learned_router(policy_config, cfg.cost_model)
    with Embedded(ServeConfig(family_dir=cfg.family_dir, port=0, router=router,
                              log_dir=Path(tempfile.mkdtemp(prefix="spin-bench-sweep-")))) as emb:
        report, mismatches = load_sweep(emb, cfg, split, fractions)
    return {**report, "policy_config": policy_config or {}, "lossless_mismatches": mismatches}


def plot_sweep(sweep: dict, path: Path) -> None:
    """Mean and p99 latency of auto and off against the request rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sweep["rates"]
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [r["rate"] for r in rows]
    for mode, style in (("auto", "o-"), ("off", "s--")):
        ax.plot(rates, [r[f"{mode}_mean_latency_s"] for r in rows], style, label=f"{mode} mean")
        ax.plot(rates, [r[f"{mode}_p99_latency_s"] for r in rows], style, alpha=0.4,
                label=f"{mode} p99")
    ax.axvline(sweep["capacity_req_s"], color="grey", linestyle=":", label="off capacity")
    ax.set_xlabel("request rate (req/s, Poisson)")
    ax.set_ylabel("end-to-end latency (s)")
    ax.set_title("SPIN serving: latency vs load (demo family)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
