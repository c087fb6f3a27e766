"""``spin zoo`` (build and measure the demo model family) and ``spin demo`` (show it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import BUILD_DIR, FAMILY_DIR
from .flags import fail, positive, write_json


def add_zoo(sub: argparse._SubParsersAction) -> None:
    """``spin zoo train`` and ``spin zoo report``."""
    zoo = sub.add_parser("zoo", help="the demo model family: build it, measure it")
    zsub = zoo.add_subparsers(dest="zoo_command", required=True)
    _add_train(zsub)
    _add_report(zsub)


def _add_train(zsub: argparse._SubParsersAction) -> None:
    train = zsub.add_parser("train", help="rebuild corpus, tokenizer and every model from scratch")
    train.add_argument("--stages", help="comma-separated subset of: corpus,tokenizer,target,"
                       "distill,drafts,prompts,head (default: all)")
    train.add_argument("--force", action="store_true", help="redo stages whose output exists")
    train.add_argument("--scale", type=positive(float), default=1.0,
                       help="multiply every token budget (0.01 for a smoke run)")
    train.add_argument("--head-budget-s", type=positive(float),
                       help="wall-clock seconds of the head's training loop (default: 900, "
                       "times --scale)")
    train.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    train.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    train.set_defaults(func=_zoo_train)


def _add_report(zsub: argparse._SubParsersAction) -> None:
    report = zsub.add_parser("report", help="measured acceptance table and forward costs")
    report.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    report.add_argument("--prompts", type=positive(int), default=16, help="prompts per domain")
    report.add_argument("--k", type=positive(int), default=4, help="speculation length")
    report.add_argument("--new-tokens", type=positive(int), default=128)
    report.add_argument("--json", help="write the full report as JSON to this file")
    report.add_argument("--readme", help="replace the report section of this README")
    report.set_defaults(func=_zoo_report)


def add_demo(sub: argparse._SubParsersAction) -> None:
    """``spin demo``: the family on held-out prompts, no services."""
    demo = sub.add_parser("demo", help="the family on held-out prompts, with per-drafter acceptance")
    demo.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    demo.add_argument("--max-tokens", type=positive(int), default=96)
    demo.set_defaults(func=_demo)


def _zoo_train(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from ..zoo.build import STAGES, build_family
    from ..zoo.head import HeadSpec
    from ..zoo.specs import DEMO_FAMILY, scaled

    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        return fail("zoo train", f"unknown stages {unknown}; expected some of {list(STAGES)}")
    family = scaled(DEMO_FAMILY, args.scale) if args.scale != 1.0 else DEMO_FAMILY
    head = HeadSpec()
    head = replace(head, prompts={d: max(8, int(n * args.scale)) for d, n in head.prompts.items()},
                   budget_s=args.head_budget_s or head.budget_s * args.scale)
    build_family(family, args.family_dir, args.build_dir, stages=stages, force=args.force,
                 head=head)
    return 0


def _zoo_report(args: argparse.Namespace) -> int:
    from ..zoo.report import ReportConfig, markdown, run_report, update_readme

    cfg = ReportConfig(family_dir=args.family_dir, prompts_per_domain=args.prompts, k=args.k,
                       new_tokens=args.new_tokens)
    report = run_report(cfg)
    table = markdown(report)
    print(table)
    write_json(args.json, report)
    if args.readme:
        update_readme(Path(args.readme), table)
        print(f"updated {args.readme}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from ..zoo.demo import demo

    demo(args.family_dir, max_tokens=args.max_tokens)
    return 0
