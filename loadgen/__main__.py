"""``python -m loadgen``: load-test the SPIN router, or any OpenAI-compatible server (like
``vllm bench serve``).

Sends a seeded workload of held-out prompts (or ``--dataset``) on a gamma arrival schedule, streams
every response, and reports TTFT / TPOT / ITL / E2E percentiles, throughput, goodput under SLOs
and speculation statistics.

Backends: ``--backend grpc`` (default) streams ``Generation.Generate`` from the router at
``--endpoint host:port``. ``--backend openai`` streams ``POST {base}/v1/completions`` (server-sent
events) from any OpenAI-compatible server (ours, vLLM, SGLang): ``--endpoint`` is ``host:port``
or a URL (``http(s)://host:port``, with or without ``/v1``), ``--model`` defaults to the first id of
``GET /v1/models``, ``--api-key`` goes as ``Authorization: Bearer``. Requests ask for
``return_token_ids`` and send ``ignore_eos`` (vLLM's extensions, which SGLang and ours accept);
a server that returns no token ids gets its streamed text counted with ``--tokenizer``. The
``speculation`` extension (ours) is sent only with ``--speculation`` or ``--k`` (other servers
may refuse unknown fields; ``--check-lossless``'s reference run always sends it, mode off).
Speculation statistics come from ``usage.speculation`` where the server sends it (ours).

``--check-lossless`` re-runs every prompt without speculation and counts requests whose greedy
tokens differ. ``--sweep`` measures capacity (the workload all at once), then runs it again at
``--sweep-fractions`` of that capacity (or at ``--sweep-rates``) on Poisson arrivals (gamma with
``--burstiness``), a table row per rate; it picks the rates itself, so ``--rate`` is refused with
it. ``--plot DIR`` writes PNG charts (latency and throughput vs rate with ``--sweep``, the TTFT
CDF, drafter acceptance over time). ``--jsonl`` / ``--dry-run`` only print the workload (no
network).

Exit code: 0 = all requests succeeded and no lossless mismatch, 1 = otherwise, 2 = bad arguments,
unreachable server or a server that refuses the run (bad key, no model).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import os
import sys
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from spin.zoo.specs import FAMILY_DIR

from . import client, openai_client
from .client import ClientConfig, EndpointUnreachable
from .datasets import chat_renderer, read_prompts
from .openai_client import HttpConfig, ServerRefused, base_url
from .plot import write_plots
from .report import RequestResult, build_report, format_report, parse_slo
from .schedule import lossless_mismatches, run_with
from .sweep import (DEFAULT_FRACTIONS, RunRecord, SweepFailed, format_sweep, parse_rates, sweep,
                    sweep_report)
from .workload import Request, build_workload

MAX_ERRORS_SHOWN = 5
"""Error messages printed to stderr at most."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("grpc", "openai"), default="grpc",
                   help="grpc: the router's gRPC API; openai: any OpenAI-compatible HTTP server "
                   "(streamed /v1/completions)")
    p.add_argument("--endpoint", default=None,
                   help="grpc: host:port (default localhost:50051); openai: host:port or "
                   "http(s)://host:port[/v1] (default http://localhost:8000)")
    p.add_argument("--model", default=None,
                   help="openai: the model to name (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                   help="the server's API key, sent as Bearer (default: $SPIN_API_KEY)")
    p.add_argument("--tls-ca", nargs="?", const="", metavar="PEM",
                   help="connect over TLS, trusting this CA certificate (alone: the system's)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rate", type=float, default=None,
                   help="requests/s (default inf = all at once); not with --sweep")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: unlimited)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    p.add_argument("--speculation", default=None,
                   help="auto (default), off, or a drafter name; openai: sent only when given")
    p.add_argument("--k", type=int, default=None,
                   help="k with a named drafter (default 0 = the router's)")
    p.add_argument("--domains", default=None, help="comma-separated, e.g. code,prose,structured")
    p.add_argument("--dataset", type=Path, metavar="PATH",
                   help="prompts of your own: JSONL with 'prompt' or 'messages', ShareGPT JSON, "
                   "or plain text (one prompt a line); default: the demo's held-out prompts")
    p.add_argument("--split", choices=("tuning", "evaluation"), default=None,
                   help="only that half of the prompts: the demo's held-out prompts, or the rows "
                   "of a --dataset whose 'split' field names it (rows without one are kept)")
    p.add_argument("--tokenizer", default=str(FAMILY_DIR / "target"),
                   help="local tokenizer directory: renders --dataset chats, and counts the "
                   "tokens of an openai server that returns no token ids (default: the demo "
                   "target's)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="stop at end-of-sequence (default: always generate --max-tokens)")
    p.add_argument("--slo", default=None, help="goodput bounds in ms, e.g. ttft:200,tpot:50")
    p.add_argument("--json", type=Path, default=None, metavar="FILE", help="write the report here")
    p.add_argument("--check-lossless", action="store_true",
                   help="re-run without speculation and count token mismatches (temperature 0)")
    p.add_argument("--sweep", action="store_true",
                   help="measure capacity, then run at fractions of it (a table row per rate)")
    p.add_argument("--sweep-fractions", default=None, metavar="F,F,...",
                   help="--sweep's rates as fractions of capacity (default "
                   f"{','.join(f'{f:g}' for f in DEFAULT_FRACTIONS)})")
    p.add_argument("--sweep-rates", default=None, metavar="R,R,...",
                   help="--sweep at these rates in req/s instead (no saturation run)")
    p.add_argument("--plot", type=Path, default=None, metavar="DIR",
                   help="write PNG charts into DIR (created)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--connect-timeout", type=float, default=10.0,
                   help="seconds to wait for the server at start")
    p.add_argument("--jsonl", action="store_true", help="print the workload as JSON lines and exit")
    p.add_argument("--dry-run", action="store_true", help="print a workload summary and exit")
    return p


def _validate(p: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, float] | None:
    """Check the arguments (exit 2 through ``p.error``); resolves the defaults that depend on
    others (rate, endpoint, sweep rates); returns the SLO."""
    if a.sweep and a.rate is not None:
        p.error("--sweep picks its own rates (saturation, then fractions of it): drop --rate, "
                "or give --sweep-rates")
    a.rate = math.inf if a.rate is None else a.rate
    for name, value in (("--num-prompts", a.num_prompts), ("--max-tokens", a.max_tokens),
                        ("--rate", a.rate), ("--burstiness", a.burstiness),
                        ("--timeout", a.timeout), ("--connect-timeout", a.connect_timeout)):
        if not value > 0:  # also rejects NaN
            p.error(f"{name} must be > 0 (got {value})")
    if a.max_concurrency is not None and a.max_concurrency <= 0:
        p.error(f"--max-concurrency must be > 0 (got {a.max_concurrency})")
    if not a.temperature >= 0:
        p.error(f"--temperature must be >= 0 (got {a.temperature})")
    if not 0 < a.top_p <= 1:
        p.error(f"--top-p must be in (0, 1] (got {a.top_p})")
    if a.k is not None and a.k < 0:
        p.error(f"--k must be >= 0 (got {a.k})")
    if a.check_lossless and a.temperature > 0:
        p.error("--check-lossless compares greedy outputs: it needs --temperature 0")
    if a.speculation is not None and not a.speculation:
        p.error("--speculation must be auto, off or a drafter name")
    if not a.sweep and (a.sweep_fractions is not None or a.sweep_rates is not None):
        p.error("--sweep-fractions and --sweep-rates need --sweep")
    if a.sweep_fractions is not None and a.sweep_rates is not None:
        p.error("give --sweep-fractions or --sweep-rates, not both")
    try:
        a.sweep_fractions = (parse_rates(a.sweep_fractions, "--sweep-fractions")
                             if a.sweep_fractions is not None else DEFAULT_FRACTIONS)
        if a.sweep_rates is not None:
            a.sweep_rates = parse_rates(a.sweep_rates, "--sweep-rates")
    except ValueError as e:
        p.error(str(e))
    if a.tls_ca and not Path(a.tls_ca).is_file():
        p.error(f"--tls-ca: no such file: {a.tls_ca}")
    if a.backend == "grpc":
        if a.model is not None:
            p.error("--model is for --backend openai (the router serves one model)")
        a.endpoint = a.endpoint or "localhost:50051"
    else:
        try:
            a.endpoint = base_url(a.endpoint or "localhost:8000", a.tls_ca)
        except ValueError as e:
            p.error(f"--endpoint: {e}")
        if a.tls_ca is not None and a.endpoint.startswith("http://"):
            p.error("--tls-ca needs an https:// endpoint")
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


def _connect(a: argparse.Namespace, cfg: ClientConfig) -> AbstractAsyncContextManager[Any]:
    if a.backend == "grpc":
        return client.connect(cfg, a.connect_timeout)
    http = HttpConfig(model=a.model, send_speculation=a.speculation is not None or a.k is not None,
                      tokenizer=a.tokenizer)
    return openai_client.connect(cfg, http, a.connect_timeout)


async def _execute(a: argparse.Namespace, cfg: ClientConfig, reqs: list[Request],
                   workload: Callable[[float], list[Request]]) -> tuple[Any, str | None]:
    """Connect and run: (a ``RunOutcome`` or a ``SweepOutcome``, the model named over HTTP)."""
    async with _connect(a, cfg) as backend:
        if a.sweep:
            out: Any = await sweep(backend, cfg, workload, a.sweep_fractions, a.sweep_rates,
                                   a.check_lossless)
        else:
            out = await run_with(backend, cfg, reqs, a.check_lossless)
        return out, getattr(backend, "model", None)


def _report_errors(failed: list[tuple[str, RequestResult]]) -> None:
    for what, r in failed[:MAX_ERRORS_SHOWN]:
        print(f"{what} {r.index} failed: {r.error_code}: {r.error_message}", file=sys.stderr)
    if len(failed) > MAX_ERRORS_SHOWN:
        print(f"... and {len(failed) - MAX_ERRORS_SHOWN} more failed requests", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (argument errors exit 2 through argparse)."""
    p = _parser()
    a = p.parse_args(argv)
    slo = _validate(p, a)
    domains = tuple(d.strip() for d in a.domains.split(",") if d.strip()) if a.domains else None
    rows = None
    try:
        if a.dataset is not None:
            if domains:
                p.error("--domains picks the demo prompts; with --dataset, filter the file")
            rows = read_prompts(a.dataset, chat_renderer(a.tokenizer) if _has_chats(a.dataset)
                                else None)

        def workload(rate: float) -> list[Request]:
            return build_workload(a.num_prompts, rate, a.burstiness, a.seed, domains=domains,
                                  rows=rows, split=a.split)

        reqs = workload(a.rate)
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

    cfg = ClientConfig(a.endpoint, a.max_tokens, a.temperature, a.seed, a.speculation or "auto",
                       a.k or 0, a.ignore_eos, a.max_concurrency, a.timeout, api_key=a.api_key,
                       tls_ca=a.tls_ca, top_p=a.top_p)
    try:
        out, model = asyncio.run(_execute(a, cfg, reqs, workload))
    except EndpointUnreachable:
        print(f"cannot reach the router at {a.endpoint}: start it with `spin serve`"
              if a.backend == "grpc" else
              f"cannot reach an OpenAI-compatible server at {a.endpoint}", file=sys.stderr)
        return 2
    except ServerRefused as e:
        print(f"the server refused the run: {e}", file=sys.stderr)
        return 2
    except SweepFailed as e:
        print(f"sweep: {e}", file=sys.stderr)
        return 1
    config = _config(a) | ({"model": model} if model is not None else {})
    if a.sweep:
        report = sweep_report(out, slo, config)
        runs = out.runs
        failed = [(f"{run.label}: request", r) for run in runs for r in run.results if not r.ok]
        entries = ([report["saturation"]] if report["saturation"] else []) + report["rates"]
        mismatches = sum(e["report"]["lossless_mismatches"] or 0 for e in entries)
        text = format_sweep(report)
    else:
        m = ref_errors = None
        if out.reference is not None:
            m, ref_errors = lossless_mismatches(out.results, out.reference)
        report = build_report(out.results, out.duration_s, slo, m, ref_errors, config)
        runs = [RunRecord("rate inf" if math.isinf(a.rate) else f"{a.rate:g} req/s", a.rate,
                          None, out.results, out.duration_s)]
        failed = [("request", r) for r in out.results if not r.ok]
        mismatches = m or 0
        text = format_report(report)
    failed += [("reference request", r) for r in out.reference or [] if not r.ok]
    _report_errors(failed)
    print(text)
    if a.json is not None:
        a.json.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    if a.plot is not None:
        paths, notes = write_plots(a.plot, runs, a.sweep)
        for note in notes:
            print(f"plot: {note}", file=sys.stderr)
        for path in paths:
            print(f"wrote {path}")
    return 0 if not failed and not mismatches else 1


if __name__ == "__main__":
    sys.exit(main())
