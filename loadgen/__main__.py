"""``python -m loadgen``: load-test the SPIN router (like ``vllm bench serve``).

Sends a seeded workload of held-out prompts on a gamma arrival schedule, streams every response,
and reports TTFT / TPOT / ITL / E2E percentiles, throughput, goodput under SLOs and speculation
statistics. ``--check-lossless`` re-runs every prompt without speculation and counts requests whose
greedy tokens differ. ``--jsonl`` / ``--dry-run`` only print the workload (no network).
Exit code: 0 = all requests succeeded and no lossless mismatch, 1 = otherwise, 2 = bad arguments or
unreachable router.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from spin.zoo.specs import FAMILY_DIR

from .client import ClientConfig, EndpointUnreachable, lossless_mismatches, run
from .datasets import chat_renderer, read_prompts
from .report import build_report, format_report, parse_slo
from .workload import build_workload

MAX_ERRORS_SHOWN = 5
"""Error messages printed to stderr at most."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default="localhost:50051", help="router address host:port")
    p.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                   help="the router's API key (default: $SPIN_API_KEY)")
    p.add_argument("--tls-ca", nargs="?", const="", metavar="PEM",
                   help="connect over TLS, trusting this CA certificate (alone: the system's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=math.inf, help="requests/s (inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: unlimited)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--speculation", default="auto", help="auto, off, or a drafter name")
    p.add_argument("--k", type=int, default=0, help="k with a named drafter (0 = the router's)")
    p.add_argument("--domains", default=None, help="comma-separated, e.g. code,prose,structured")
    p.add_argument("--dataset", type=Path, metavar="PATH",
                   help="prompts of your own: JSONL with 'prompt' or 'messages', ShareGPT JSON, "
                   "or plain text (one prompt a line); default: the demo's held-out prompts")
    p.add_argument("--tokenizer", default=str(FAMILY_DIR / "target"),
                   help="the tokenizer whose chat template renders --dataset chats (default: "
                   "the demo target's)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at end-of-sequence (default: always generate --max-tokens)")
    p.add_argument("--slo", default=None, help="goodput bounds in ms, e.g. ttft:200,tpot:50")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report here")
    p.add_argument("--check-lossless", action="store_true",
                   help="re-run without speculation and count token mismatches (temperature 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for the router at start")
    p.add_argument("--jsonl", action="store_true", help="print the workload as JSON lines and exit")
    p.add_argument("--dry-run", action="store_true", help="print a workload summary and exit")
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, float] | None:
    for name, value in (("--num-prompts", a.num_prompts), ("--max-tokens", a.max_tokens),
                        ("--rate", a.rate), ("--burstiness", a.burstiness),
                        ("--timeout", a.timeout), ("--connect-timeout", a.connect_timeout)):
        if not value > 0:  # also rejects NaN
            p.error(f"{name} must be > 0 (got {value})")
    if a.max_concurrency is not None and a.max_concurrency <= 0:
        p.error(f"--max-concurrency must be > 0 (got {a.max_concurrency})")
    if not a.temperature >= 0:
        p.error(f"--temperature must be >= 0 (got {a.temperature})")
    if a.k < 0:
        p.error(f"--k must be >= 0 (got {a.k})")
    if a.check_lossless and a.temperature > 0:
        p.error("--check-lossless compares greedy outputs: it needs --temperature 0")
    if not a.speculation:
        p.error("--speculation must be auto, off or a drafter name")
    try:
        return parse_slo(a.slo) if a.slo is not None else None
    except ValueError as e:
        p.error(f"--slo: {e}")


def _config(a: argparse.Namespace) -> dict[str, Any]:
    """The arguments as JSON-safe values (infinite rate -> "inf")."""
    out: dict[str, Any] = {}
    for k, v in vars(a).items():
        if isinstance(v, float) and math.isinf(v):
            v = "inf"
        elif isinstance(v, Path):
            v = str(v)
        out[k] = v
    return out


def _has_chats(path: Path) -> bool:
    """Whether a JSONL dataset has chat lines (only then is a tokenizer loaded)."""
    return path.suffix == ".jsonl" and '"messages"' in path.read_text(encoding="utf-8",
                                                                        errors="replace")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argument errors exit 2 through argparse)."""
    p = _parser()
    a = p.parse_args(argv)
    slo = _validate(p, a)
    domains = tuple(d.strip() for d in a.domains.split(",") if d.strip()) if a.domains else None
    try:
        rows = None
        if a.dataset is not None:
            if domains:
                p.error("--domains picks the demo prompts; with --dataset, filter the file")
            rows = read_prompts(a.dataset, chat_renderer(a.tokenizer) if _has_chats(a.dataset)
                                else None)
        reqs = build_workload(a.num_prompts, a.rate, a.burstiness, a.seed, domains=domains,
                              rows=rows)
    except (ValueError, FileNotFoundError, KeyError, OSError) as e:
        p.error(str(e))
    if a.jsonl:
        for r in reqs:
            print(json.dumps(r.__dict__))
        return 0
    if a.dry_run:
        mix = collections.Counter(r.domain for r in reqs)
        print(f"{len(reqs)} requests over {reqs[-1].arrival_s:.2f} s; mix {dict(mix)}")
        return 0

    cfg = ClientConfig(a.endpoint, a.max_tokens, a.temperature, a.seed, a.speculation, a.k,
                       a.ignore_eos, a.max_concurrency, a.timeout, api_key=a.api_key,
                       tls_ca=a.tls_ca)
    try:
        outcome = asyncio.run(run(cfg, reqs, a.check_lossless, a.connect_timeout))
    except EndpointUnreachable:
        print(f"cannot reach the router at {a.endpoint}: start it with `spin serve`",
              file=sys.stderr)
        return 2
    mismatches = ref_errors = None
    if outcome.reference is not None:
        mismatches, ref_errors = lossless_mismatches(outcome.results, outcome.reference)
    report = build_report(outcome.results, outcome.duration_s, slo, mismatches, ref_errors,
                          _config(a))
    failed = [("request", r) for r in outcome.results if not r.ok]
    failed += [("reference request", r) for r in outcome.reference or [] if not r.ok]
    for what, r in failed[:MAX_ERRORS_SHOWN]:
        print(f"{what} {r.index} failed: {r.error_code}: {r.error_message}", file=sys.stderr)
    if len(failed) > MAX_ERRORS_SHOWN:
        print(f"... and {len(failed) - MAX_ERRORS_SHOWN} more failed requests", file=sys.stderr)
    print(format_report(report))
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return 0 if not failed and not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
