"""``--sweep``: latency and throughput against the request rate.

First the saturation run: the whole workload at once (rate inf, under ``--max-concurrency`` if
given); the server's capacity is its completed requests over its wall time. Then the same
prompts again at fractions of that capacity (``--sweep-fractions``), or at given rates
(``--sweep-rates``, no saturation run), each on gamma arrivals (``--burstiness``; 1.0 = Poisson)
from the same seed. With ``--check-lossless`` one reference run without speculation follows, and
every run is compared with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .report import RequestResult, build_report
from .schedule import Backend, lossless_mismatches, reference_run, send_all
from .workload import Request

if TYPE_CHECKING:
    from .client import ClientConfig

DEFAULT_FRACTIONS = (0.25, 0.5, 1.0, 1.5, 2.0)
"""Rates of a sweep, as fractions of the measured capacity."""


class SweepFailed(Exception):
    """No request of the saturation run completed: there is no capacity to take fractions of."""


@dataclass
class RunRecord:
    """One run of a load test (a sweep has several)."""

    label: str
    """``saturation``, ``N req/s`` or ``rate inf``."""
    rate: float
    """Offered request rate in req/s (inf: all at once)."""
    fraction: float | None
    """``rate`` as a fraction of the measured capacity (None: not a fraction)."""
    results: list[RequestResult]
    """Per request, in workload order."""
    duration_s: float
    """Wall time of the run."""
    offset_s: float = 0.0
    """When the run started, seconds after the first run of the test started."""


@dataclass
class SweepOutcome:
    """Every run of a sweep."""

    capacity: float | None
    """Completed requests / wall second of the saturation run (None with given rates)."""
    runs: list[RunRecord]
    """The saturation run (if any), then one run per rate, in the order they ran."""
    reference: list[RequestResult] | None = None
    """The lossless reference run, when checked."""


def parse_rates(text: str, what: str) -> tuple[float, ...]:
    """``"0.5,1,2"`` -> ``(0.5, 1.0, 2.0)``: finite numbers > 0; ValueError naming ``what``."""
    values = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{what}: {part.strip()!r} is not a number") from None
        if not 0 < v < math.inf:
            raise ValueError(f"{what}: every value must be a finite number > 0 (got {v})")
        values.append(v)
    return tuple(values)


def _label(rate: float) -> str:
    return f"{rate:.3g} req/s"


async def sweep(backend: Backend, cfg: ClientConfig, workload: Callable[[float], list[Request]],
                fractions: Sequence[float] = DEFAULT_FRACTIONS,
                rates: Sequence[float] | None = None, check_lossless: bool = False,
                progress: bool = True) -> SweepOutcome:
    """Run the sweep; ``workload(rate)`` builds the requests of one rate (the same prompts each
    time). ``rates`` instead of ``fractions``: no saturation run. ``SweepFailed`` when the
    saturation run completed nothing."""
    t0 = time.perf_counter()
    runs: list[RunRecord] = []

    async def one(label: str, rate: float, fraction: float | None) -> RunRecord:
        start = time.perf_counter() - t0
        results, wall = await send_all(backend, workload(rate), cfg, label, progress=progress)
        runs.append(RunRecord(label, rate, fraction, results, wall, start))
        return runs[-1]

    capacity = None
    if rates is None:
        sat = await one("saturation", math.inf, None)
        done = sum(r.ok for r in sat.results)
        if not done:
            raise SweepFailed("no request of the saturation run completed")
        capacity = done / sat.duration_s
        plan = [(f * capacity, f) for f in fractions]
    else:
        plan = [(r, None) for r in rates]
    for rate, fraction in plan:
        await one(_label(rate), rate, fraction)
    reference = None
    if check_lossless:
        reference = await reference_run(backend, workload(math.inf), cfg, progress)
    return SweepOutcome(capacity, runs, reference)


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def sweep_report(out: SweepOutcome, slo: Mapping[str, float] | None = None,
                 config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report: the capacity, the saturation run's report and one entry per rate (each
    with its full ``build_report``)."""
    entries = []
    for run in out.runs:
        mismatches = ref_errors = None
        if out.reference is not None:
            mismatches, ref_errors = lossless_mismatches(run.results, out.reference)
        entries.append({"label": run.label, "rate_requests_per_s": _rate_json(run.rate),
                        "fraction_of_capacity": run.fraction, "started_s": run.offset_s,
                        "report": build_report(run.results, run.duration_s, slo, mismatches,
                                               ref_errors, {"rate": _rate_json(run.rate)})})
    saturation = entries[0] if out.capacity is not None else None
    return {"sweep": True, "capacity_requests_per_s": out.capacity, "saturation": saturation,
            "rates": entries[1:] if saturation is not None else entries,
            "config": dict(config or {})}


def _ms(stats: Mapping[str, float] | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key]:.0f}"


def format_sweep(rep: Mapping[str, Any]) -> str:
    """One table row per run: offered and achieved rate, throughput, latency, failures."""
    header = ("Rate req/s", "x cap", "Done req/s", "Out tok/s", "E2E mean", "E2E p50",
              "E2E p99", "TTFT p50", "TTFT p99", "Failed")
    checked = any(e["report"]["lossless_mismatches"] is not None for e in rep["rates"])
    if checked:
        header += ("Mismatch",)
    rows = []
    for e in ([rep["saturation"]] if rep["saturation"] else []) + list(rep["rates"]):
        r, tp = e["report"], e["report"]["throughput"]
        rate = e["rate_requests_per_s"]
        row = ("inf (sat)" if rate == "inf" else f"{rate:.2f}",
               "-" if e["fraction_of_capacity"] is None else f"{e['fraction_of_capacity']:.2f}",
               "-" if tp["requests_per_s"] is None else f"{tp['requests_per_s']:.2f}",
               "-" if tp["output_tokens_per_s"] is None else f"{tp['output_tokens_per_s']:.1f}",
               _ms(r["e2e"], "mean_ms"), _ms(r["e2e"], "p50_ms"), _ms(r["e2e"], "p99_ms"),
               _ms(r["ttft"], "p50_ms"), _ms(r["ttft"], "p99_ms"), str(r["errors"]))
        if checked:
            row += (str(r["lossless_mismatches"]),)
        rows.append(row)
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines = ["  ".join(f"{c:>{w}}" for c, w in zip(row, widths)) for row in [header, *rows]]
    cap = rep["capacity_requests_per_s"]
    title = " Rate sweep (latencies in ms) "
    rule = "=" * len(lines[0])
    head = [title.center(len(rule), "=")]
    if cap is not None:
        head.append(f"Capacity (saturation run): {cap:.2f} req/s")
    return "\n".join([*head, lines[0], "-" * len(rule), *lines[1:], rule])
