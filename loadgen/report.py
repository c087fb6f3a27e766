"""Statistics of a load-generator run: latency percentiles, throughput, goodput, speculation.

Definitions (as in ``vllm bench serve``):

- TTFT: request sent -> first response message carrying at least one token.
- ITL: gap between two successive token-carrying messages. With speculative decoding tokens arrive
  in bursts (one message per verification step, carrying every token accepted in it), so one
  message of n tokens counts as ONE gap, not n: ITL measures how often the client hears from the
  server, TPOT how fast tokens flow. All gaps of all completed requests are pooled.
- TPOT: (E2E - TTFT) / (output tokens - 1), only for requests with more than one output token.
- E2E: request sent -> last message received.

Percentiles interpolate linearly between order statistics (``numpy.percentile``'s default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

SLO_METRICS = ("ttft", "tpot", "e2e")
"""Metrics an SLO may bound (milliseconds, per request)."""


@dataclass
class DrafterCounts:
    """Speculation of one drafter, summed over one or more requests."""

    steps: int = 0
    """Verification steps that used this drafter."""
    draft_tokens: int = 0
    """Draft tokens it proposed."""
    accepted_tokens: int = 0
    """Draft tokens the verifier accepted."""


@dataclass
class SpecCounts:
    """Speculation statistics of one request (the last message's ``SpeculationStats``)."""

    steps: int = 0
    """Verification steps."""
    steps_without_speculation: int = 0
    """Steps with k = 0."""
    draft_tokens: int = 0
    """Draft tokens proposed, all drafters."""
    accepted_tokens: int = 0
    """Draft tokens accepted, all drafters."""
    drafters: dict[str, DrafterCounts] = field(default_factory=dict)
    """Per-drafter counts, by drafter name."""


@dataclass
class RequestResult:
    """What the client observed for one request."""

    index: int
    """Position in the workload."""
    ok: bool = False
    """The stream finished with a finish reason and no error."""
    error_code: str | None = None
    """When not ok: the gRPC status code name; over HTTP ``HTTP_<status>``, ``CONNECTION_ERROR``,
    ``TIMEOUT``, ``STREAM_ERROR`` (an error event mid-stream) or ``BAD_EVENT``; with either
    ``INCOMPLETE_STREAM`` (no finish reason)."""
    error_message: str | None = None
    """Error details when not ok."""
    start_s: float | None = None
    """When the request was sent, seconds after its run started."""
    ttft_s: float | None = None
    """Send -> first token-carrying message (None if no token arrived)."""
    itls_s: list[float] = field(default_factory=list)
    """Gaps between successive token-carrying messages."""
    e2e_s: float | None = None
    """Send -> last message."""
    token_ids: list[int] = field(default_factory=list)
    """Output token ids, in order (over HTTP from a server that returns none: the streamed text
    tokenized after the run)."""
    text: str = ""
    """Output text (HTTP only: the gRPC client does not keep it)."""
    prompt_tokens: int = 0
    """``usage.prompt_tokens`` of the last message (HTTP without usage: the prompt tokenized)."""
    speculation: SpecCounts = field(default_factory=SpecCounts)
    """Speculation stats of the last message."""

    @property
    def output_tokens(self) -> int:
        """Number of output tokens received."""
        return len(self.token_ids)

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; ``values`` must be non-empty."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def latency_stats(values_s: Sequence[float]) -> dict[str, float] | None:
    """Mean, median and p99 in milliseconds; None for no values."""
    if not values_s:
        return None
    ms = [v * 1000 for v in values_s]
    return {"mean_ms": sum(ms) / len(ms), "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99)}


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft:200,tpot:50"`` -> ``{"ttft": 200.0, "tpot": 50.0}`` (milliseconds)."""
    slo: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.strip().partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad SLO {part.strip()!r}: expected METRIC:MS with METRIC in "
                             f"{', '.join(SLO_METRICS)} (e.g. ttft:200,tpot:50)")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part.strip()!r}: {value!r} is not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad SLO {part.strip()!r}: the bound must be a finite number > 0")
        if name in slo:
            raise ValueError(f"SLO {name!r} given twice")
        slo[name] = ms
    return slo


def meets_slo(r: RequestResult, slo: Mapping[str, float]) -> bool:
    """True if a completed request meets every bound (a single-token request has no TPOT)."""
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s, "e2e": r.e2e_s}
    for name, bound_ms in slo.items():
        v = values[name]
        if v is None:
            if name == "tpot" and r.ok:
                continue
            return False
        if v * 1000 > bound_ms:
            return False
    return r.ok


def _speculation(done: Sequence[RequestResult]) -> dict[str, Any]:
    total = SpecCounts()
    for r in done:
        s = r.speculation
        total.steps += s.steps
        total.steps_without_speculation += s.steps_without_speculation
        total.draft_tokens += s.draft_tokens
        total.accepted_tokens += s.accepted_tokens
        for name, d in s.drafters.items():
            t = total.drafters.setdefault(name, DrafterCounts())
            t.steps += d.steps
            t.draft_tokens += d.draft_tokens
            t.accepted_tokens += d.accepted_tokens

    def rate(acc: int, drafted: int) -> float | None:
        return acc / drafted if drafted else None

    return {
        "steps": total.steps, "steps_without_speculation": total.steps_without_speculation,
        "draft_tokens": total.draft_tokens, "accepted_tokens": total.accepted_tokens,
        "acceptance_rate": rate(total.accepted_tokens, total.draft_tokens),
        "drafters": {name: {"steps": d.steps, "draft_tokens": d.draft_tokens,
                            "accepted_tokens": d.accepted_tokens,
                            "acceptance_rate": rate(d.accepted_tokens, d.draft_tokens)}
                     for name, d in sorted(total.drafters.items())},
    }


def build_report(results: Sequence[RequestResult], duration_s: float,
                 slo: Mapping[str, float] | None = None,
                 lossless_mismatches: int | None = None, lossless_errors: int | None = None,
                 config: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON report of a run (see the module docstring for the metric definitions)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    codes: dict[str, int] = {}
    for r in failed:
        codes[r.error_code or "UNKNOWN"] = codes.get(r.error_code or "UNKNOWN", 0) + 1
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_tokens for r in done)
    steps = sum(r.speculation.steps for r in done)

    def per_s(x: float) -> float | None:
        return x / duration_s if duration_s > 0 else None

    goodput = None
    if slo:
        good = sum(meets_slo(r, slo) for r in done)
        goodput = {"requests": good, "requests_per_s": per_s(good),
                   "slo": {f"{k}_ms": v for k, v in slo.items()}}
    return {
        "completed": len(done), "errors": len(failed), "error_codes": dict(sorted(codes.items())),
        "lossless_mismatches": lossless_mismatches, "lossless_errors": lossless_errors,
        "duration_s": duration_s,
        "output_tokens": out_tokens, "prompt_tokens": in_tokens,
        "ttft": latency_stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot": latency_stats([t for r in done if (t := r.tpot_s) is not None]),
        "itl": latency_stats([g for r in done for g in r.itls_s]),
        "e2e": latency_stats([r.e2e_s for r in done if r.e2e_s is not None]),
        "throughput": {"requests_per_s": per_s(len(done)), "output_tokens_per_s": per_s(out_tokens),
                       "total_tokens_per_s": per_s(out_tokens + in_tokens)},
        "goodput": goodput,
        "tau": out_tokens / steps if steps else None,
        "speculation": _speculation(done),
        "config": dict(config or {}),
    }


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def format_report(rep: Mapping[str, Any]) -> str:
    """A human-readable table of a report."""
    rows: list[tuple[str, Any]] = [
        ("Completed requests", rep["completed"]), ("Failed requests", rep["errors"])]
    rows += [(f"  {code}", n) for code, n in rep["error_codes"].items()]
    if rep["lossless_mismatches"] is not None:
        rows.append(("Lossless mismatches", rep["lossless_mismatches"]))
        rows.append(("Lossless reference errors", rep["lossless_errors"]))
    tp, spec = rep["throughput"], rep["speculation"]
    rows += [("Duration (s)", rep["duration_s"]), ("Output tokens", rep["output_tokens"]),
             ("Request throughput (req/s)", tp["requests_per_s"]),
             ("Output token throughput (tok/s)", tp["output_tokens_per_s"]),
             ("Total token throughput (tok/s)", tp["total_tokens_per_s"])]
    if rep["goodput"] is not None:
        rows.append(("Goodput (req/s)", rep["goodput"]["requests_per_s"]))
    for key, title in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E")):
        s = rep[key] or {}
        rows += [(f"{title} {stat} (ms)", s.get(f"{stat}_ms")) for stat in ("mean", "p50", "p99")]
    rows += [("Tau (tokens / step)", rep["tau"]), ("Draft tokens", spec["draft_tokens"]),
             ("Acceptance rate", spec["acceptance_rate"])]
    rows += [(f"  {name} steps / acceptance", f"{d['steps']} / {_fmt(d['acceptance_rate'])}")
             for name, d in spec["drafters"].items()]
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 14)
    body = "\n".join(f"{k:<{width}}{_fmt(v):>14}" for k, v in rows)
    return f"{' Load test result '.center(len(line), '=')}\n{body}\n{line}"
