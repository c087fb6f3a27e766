"""``spin bench learned``: the warmed learned policy against speculation off and one fixed
configuration on tuning prompts, with its step trace (``bench/learned.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import fail, policy_overrides, positive, write_json


def add_learned(bsub: argparse._SubParsersAction) -> None:
    bl = bsub.add_parser("learned", help="why the warmed learned policy gains or loses against "
                         "off and one fixed configuration: its steps, traced (tuning prompts)")
    bl.add_argument("--fixed", default="eagle:4",
                    help="the fixed configuration, DRAFTER:K (default eagle:4, the demo's head)")
    bl.add_argument("--greedy", action="store_true",
                    help="time greedy requests (default: sampled, temperature 0.8, top-p 0.95)")
    bl.add_argument("--split", choices=("tuning", "evaluation"), default="tuning",
                    help="the held-out prompts' half timed (default tuning: what this is used "
                    "to change must not be timed on the evaluation prompts)")
    bl.add_argument("--requests", type=positive(int), default=9)
    bl.add_argument("--passes", type=positive(int), default=2)
    bl.add_argument("--new-tokens", type=positive(int), default=64)
    bl.add_argument("--seed", type=int, default=0)
    bl.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings")
    bl.add_argument("--trace", type=Path, default=None,
                    help="write the step trace here (default: a temporary directory)")
    bl.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bl.add_argument("--json", default=None, help="write the report here")
    bl.set_defaults(func=_bench_learned)


def _bench_learned(args: argparse.Namespace) -> int:
    from ..bench.learned import LearnedBenchConfig, run_learned, summary

    drafter, _, k = args.fixed.rpartition(":")
    if not drafter or not k.isdigit() or int(k) <= 0:
        return fail("bench learned", f"--fixed {args.fixed!r}: expected DRAFTER:K, K > 0")
    try:
        overrides = policy_overrides(args.policy_config)
        report = run_learned(LearnedBenchConfig(
            args.family_dir, drafter, int(k), not args.greedy, args.split, args.requests,
            args.passes, args.new_tokens, args.seed, overrides, args.trace))
    except ValueError as e:
        return fail("bench learned", e)
    print(summary(report))
    write_json(args.json, report)
    return 0
