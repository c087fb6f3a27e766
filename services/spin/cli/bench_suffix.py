"""``spin bench suffix``: auto with suffix decoding in the pool against auto without it, on the
edit workload (``bench/suffix.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import fail, policy_overrides, positive, write_json


def add_suffix(bsub: argparse._SubParsersAction) -> None:
    bs = bsub.add_parser("suffix", help="auto with suffix decoding vs auto without it on the "
                         "edit workload (single stream, greedy; two deployments side by side)")
    bs.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bs.add_argument("--dataset", type=Path, default=None,
                    help="an edit workload (python -m loadgen.edit); default: built from "
                    "benchmarks/datasets/unseen-long.jsonl's --split")
    bs.add_argument("--split", choices=("evaluation", "tuning"), default="evaluation")
    bs.add_argument("--groups", type=positive(int), default=6,
                    help="groups (a text, then its edits) per pass (default 6)")
    bs.add_argument("--rounds", type=positive(int), default=2,
                    help="passes, each over groups of its own (default 2)")
    bs.add_argument("--edits", type=positive(int), default=2, help="edits per text (default 2)")
    bs.add_argument("--words", type=positive(int), default=3,
                    help="words replaced per edit (default 3)")
    bs.add_argument("--new-tokens", type=positive(int), default=64)
    bs.add_argument("--seed", type=int, default=0)
    bs.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings (both deployments)")
    bs.add_argument("--share", action="store_true",
                    help="compare two routers sharing suffix decoding's texts through Redis "
                    "(--suffix-share) against two that do not: originals to the first router, "
                    "edits to the second")
    bs.add_argument("--json", default=None, help="write the report here")
    bs.set_defaults(func=_bench_suffix)


def _bench_suffix(args: argparse.Namespace) -> int:
    from ..bench.suffix import SuffixBenchConfig, run_suffix, summary

    try:
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        return fail("bench suffix", e)
    if args.dataset is not None and not args.dataset.is_file():
        return fail("bench suffix", f"--dataset {args.dataset}: no such file")
    try:
        report = run_suffix(SuffixBenchConfig(
            args.family_dir, args.dataset, args.split, args.groups, args.rounds, args.edits,
            args.words, args.new_tokens, args.seed, overrides, args.share))
    except ValueError as e:
        return fail("bench suffix", e)
    print(summary(report))
    write_json(args.json, report)
    return 0 if report["greedy_mismatches"] == 0 else 1
