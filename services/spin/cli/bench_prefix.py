"""``spin bench prefix``: the chat workload with prefix caching on and off (``bench/prefix.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import positive, write_json


def add_prefix(bsub: argparse._SubParsersAction) -> None:
    from loadgen.chat import DEFAULT_SOURCE, ChatShape

    d = ChatShape()
    bp = bsub.add_parser("prefix", help="a multi-turn chat workload with a shared system prompt, "
                         "prefix caching on and off side by side (TTFT, throughput, lossless)")
    bp.add_argument("--concurrency", type=positive(int), default=32)
    bp.add_argument("--requests", type=positive(int), default=64,
                    help="requests per pass and deployment")
    bp.add_argument("--rounds", type=positive(int), default=2,
                    help="passes, the deployments' order reversed every other one")
    bp.add_argument("--new-tokens", type=positive(int), default=32)
    bp.add_argument("--speculation", default="auto",
                    help="the requests' speculation mode (default auto; off, or a drafter name)")
    bp.add_argument("--system-tokens", type=positive(int), default=d.system_tokens)
    bp.add_argument("--turns", type=positive(int), default=d.turns)
    bp.add_argument("--source", type=Path, default=DEFAULT_SOURCE,
                    help="the text the workload is cut from (its evaluation half)")
    bp.add_argument("--json", help="write the report as JSON to this file")
    bp.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bp.set_defaults(func=_bench_prefix)


def _bench_prefix(args: argparse.Namespace) -> int:
    from loadgen.chat import ChatShape

    from ..bench.prefix import PrefixBenchConfig, run_prefix, table

    report = run_prefix(PrefixBenchConfig(
        family_dir=args.family_dir, source=args.source, concurrency=args.concurrency,
        requests=args.requests, rounds=args.rounds, new_tokens=args.new_tokens,
        speculation=args.speculation,
        shape=ChatShape(system_tokens=args.system_tokens, turns=args.turns)))
    print(table(report))
    write_json(args.json, report)
    return 0 if report["greedy_mismatches"] == 0 else 1
