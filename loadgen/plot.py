"""``--plot DIR``: PNG charts of a load test (matplotlib, Agg backend: no display needed).

- ``latency_vs_rate.png``: p50 and p99 E2E against the offered rate (a sweep only);
- ``throughput_vs_rate.png``: achieved output tokens/s against the offered rate (a sweep only);
- ``ttft_cdf.png``: the TTFT distribution of every run;
- ``acceptance_over_time.png``: per drafter, accepted / drafted tokens of the requests that
  completed in each time bucket (the runs of a sweep one after the other, as they ran); only
  when the server returned per-drafter speculation statistics.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import RequestResult, percentile
from .sweep import RunRecord

BUCKETS = 20
"""Time buckets of the acceptance chart at most."""
MIN_PER_BUCKET = 4
"""Completed requests per bucket at least, on average (fewer buckets for small runs)."""


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str,
          fraction: bool = False) -> Path:
    """Label, grid and write the chart; ``fraction``: a y axis from 0 to 1 and a small legend
    (several lines), else from 0 up."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if fraction:
        ax.set_ylim(0, 1.02)
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small" if fraction else None)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def _e2e_ms(results: Sequence[RequestResult]) -> list[float]:
    return [r.e2e_s * 1000 for r in results if r.ok and r.e2e_s is not None]


def latency_vs_rate(runs: Sequence[RunRecord], path: Path) -> Path:
    """p50 and p99 E2E of each finite-rate run against its offered rate."""
    plt = _pyplot()
    pts = sorted((run.rate, _e2e_ms(run.results)) for run in runs if not math.isinf(run.rate))
    pts = [(rate, ms) for rate, ms in pts if ms]
    fig, ax = plt.subplots(figsize=(6, 4))
    rates = [rate for rate, _ in pts]
    ax.plot(rates, [percentile(ms, 50) for _, ms in pts], "o-", label="p50")
    ax.plot(rates, [percentile(ms, 99) for _, ms in pts], "s--", label="p99")
    _capacity_line(ax, runs)
    return _save(fig, ax, path, "offered request rate (req/s)", "end-to-end latency (ms)",
                 "Latency vs request rate")


def _saturation_run(runs: Sequence[RunRecord]) -> RunRecord | None:
    """The first run that sent its whole workload at once (infinite rate), if any."""
    return next((run for run in runs if math.isinf(run.rate) and run.duration_s > 0), None)


def _capacity_line(ax: Any, runs: Sequence[RunRecord]) -> None:
    run = _saturation_run(runs)
    if run is not None:
        done = sum(r.ok for r in run.results)
        ax.axvline(done / run.duration_s, color="grey", linestyle=":", label="capacity")


def throughput_vs_rate(runs: Sequence[RunRecord], path: Path) -> Path:
    """Achieved output tokens/s of each finite-rate run against its offered rate."""
    plt = _pyplot()
    pts = sorted((run.rate, sum(r.output_tokens for r in run.results if r.ok) / run.duration_s)
                 for run in runs if not math.isinf(run.rate) and run.duration_s > 0)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label="achieved")
    sat = _saturation_run(runs)
    if sat is not None:
        ax.axhline(sum(r.output_tokens for r in sat.results if r.ok) / sat.duration_s,
                   color="grey", linestyle=":", label="saturation run")
    _capacity_line(ax, runs)
    return _save(fig, ax, path, "offered request rate (req/s)", "output tokens/s",
                 "Throughput vs request rate")


def ttft_cdf(runs: Sequence[RunRecord], path: Path) -> Path:
    """The empirical CDF of TTFT, one line per run."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        ms = sorted(r.ttft_s * 1000 for r in run.results if r.ok and r.ttft_s is not None)
        if ms:
            ax.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post",
                    label=run.label)
    return _save(fig, ax, path, "time to first token (ms)", "fraction of requests",
                 "TTFT distribution", fraction=True)


def acceptance_series(runs: Sequence[RunRecord],
                      ) -> tuple[list[float], dict[str, list[float | None]]]:
    """Bucket centres (seconds since the first run started) and, per drafter, accepted / drafted
    of the requests completed in each bucket (None: nothing drafted there). Empty when no
    request reported drafts."""
    done = [(run.offset_s + r.start_s + r.e2e_s, r) for run in runs for r in run.results
            if r.ok and r.start_s is not None and r.e2e_s is not None]
    names = sorted({n for _, r in done for n, d in r.speculation.drafters.items()
                    if d.draft_tokens})
    if not names:
        return [], {}
    t_end = max(t for t, _ in done)
    n = max(1, min(BUCKETS, len(done) // MIN_PER_BUCKET))
    width = t_end / n if t_end > 0 else 1.0
    sums = {name: [[0, 0] for _ in range(n)] for name in names}
    for t, r in done:
        b = min(int(t / width), n - 1)
        for name, d in r.speculation.drafters.items():
            if name in sums:
                sums[name][b][0] += d.accepted_tokens
                sums[name][b][1] += d.draft_tokens
    centres = [(i + 0.5) * width for i in range(n)]
    return centres, {name: [a / d if d else None for a, d in rows] for name, rows in sums.items()}


def acceptance_over_time(runs: Sequence[RunRecord], path: Path) -> Path | None:
    """Per-drafter acceptance by completion time; None (nothing written) without drafts."""
    centres, series = acceptance_series(runs)
    if not series:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rates in series.items():
        xs = [x for x, v in zip(centres, rates) if v is not None]
        ax.plot(xs, [v for v in rates if v is not None], "o-", markersize=3, label=name)
    if len(runs) > 1:
        for run in runs[1:]:
            ax.axvline(run.offset_s, color="grey", linestyle=":", linewidth=0.8)
    return _save(fig, ax, path, "completion time (s since the start"
                 + ("; dotted: a new run)" if len(runs) > 1 else ")"),
                 "acceptance rate (accepted / drafted)", "Draft acceptance over time",
                 fraction=True)


def write_plots(out_dir: Path, runs: Sequence[RunRecord],
                swept: bool) -> tuple[list[Path], list[str]]:
    """Write the charts into ``out_dir`` (created); returns the paths written and a note for
    each chart skipped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    notes: list[str] = []
    if swept and any(not math.isinf(run.rate) for run in runs):
        paths.append(latency_vs_rate(runs, out_dir / "latency_vs_rate.png"))
        paths.append(throughput_vs_rate(runs, out_dir / "throughput_vs_rate.png"))
    else:
        notes.append("latency_vs_rate.png and throughput_vs_rate.png need --sweep: skipped")
    paths.append(ttft_cdf(runs, out_dir / "ttft_cdf.png"))
    acc = acceptance_over_time(runs, out_dir / "acceptance_over_time.png")
    if acc is None:
        notes.append("acceptance_over_time.png: the server returned no per-drafter speculation "
                     "statistics (or nothing was drafted): skipped")
    else:
        paths.append(acc)
    return paths, notes
