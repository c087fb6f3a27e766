"""``spin bench structured``: structured output with the grammar drafter in the pool against
without it, on the schema workload (``bench/structured.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import fail, policy_overrides, positive, positive_ints, temperatures, write_json



def add_structured(bsub: argparse._SubParsersAction) -> None:
    bs = bsub.add_parser("structured", help="structured output: auto with the grammar drafter "
                         "vs auto without it vs off on the schema workload (two deployments "
                         "side by side)")
    bs.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bs.add_argument("--dataset", type=Path, default=None,
                    help="a schema workload (python -m loadgen.schemas); default: built from "
                    "benchmarks/datasets/unseen-long.jsonl's --split")
    bs.add_argument("--split", choices=("evaluation", "tuning"), default="evaluation")
    bs.add_argument("--requests", type=positive(int), default=16,
                    help="requests per cell (default 16)")
    bs.add_argument("--concurrency", type=positive_ints, default=(1, 16),
                    help="requests in flight per cell, comma-separated (default 1,16)")
    bs.add_argument("--temperatures", type=temperatures, default=(0.0, 0.8),
                    help="temperatures, comma-separated (default 0,0.8)")
    bs.add_argument("--new-tokens", type=positive(int), default=160)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings (both deployments)")
    bs.add_argument("--json", default=None, help="write the report here")
    bs.set_defaults(func=_bench_structured)


def _bench_structured(args: argparse.Namespace) -> int:
    from ..bench.structured import StructuredBenchConfig, run_structured, summary

    try:
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        return fail("bench structured", e)
    if args.dataset is not None and not args.dataset.is_file():
        return fail("bench structured", f"--dataset {args.dataset}: no such file")
    try:
        report = run_structured(StructuredBenchConfig(
            args.family_dir, args.dataset, args.split, args.requests, args.concurrency,
            args.temperatures, args.new_tokens, args.seed, overrides))
    except ValueError as e:
        return fail("bench structured", e)
    print(summary(report))
    write_json(args.json, report)
    return 0 if all(c["greedy_mismatches"] in (0, None) for c in report["cells"]) else 1
