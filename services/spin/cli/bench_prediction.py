"""``spin bench prediction``: Predicted Outputs against the same requests without a prediction
and with speculation off, on the code-edit workload (``bench/prediction.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import fail, policy_overrides, positive, temperatures, write_json


def add_prediction(bsub: argparse._SubParsersAction) -> None:
    bp = bsub.add_parser("prediction", help="Predicted Outputs: auto with each request's "
                         "prediction vs without vs off on the code-edit workload (three "
                         "deployments side by side, single stream)")
    bp.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bp.add_argument("--source", choices=("previous-output", "file"), default="previous-output",
                    help="what a request predicts: the output its group's previous version got "
                    "(default), or the file as its group started")
    bp.add_argument("--dataset", type=Path, default=None,
                    help="an edit workload (python -m loadgen.edit); default: built from "
                    "benchmarks/datasets/unseen-long.jsonl's --split and --domain")
    bp.add_argument("--split", choices=("evaluation", "tuning"), default="evaluation")
    bp.add_argument("--domain", default="code", help="source texts' domain (default code)")
    bp.add_argument("--groups", type=positive(int), default=6,
                    help="groups (a file, then its edits) per temperature (default 6)")
    bp.add_argument("--edits", type=positive(int), default=2, help="edits per file (default 2)")
    bp.add_argument("--words", type=positive(int), default=3,
                    help="words replaced per edit (default 3)")
    bp.add_argument("--temperatures", type=temperatures, default=(0.0, 0.8),
                    help="temperatures, comma-separated (default 0,0.8)")
    bp.add_argument("--new-tokens", type=positive(int), default=128)
    bp.add_argument("--seed", type=int, default=0)
    bp.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings (every deployment)")
    bp.add_argument("--json", default=None, help="write the report here")
    bp.set_defaults(func=_bench_prediction)


def _bench_prediction(args: argparse.Namespace) -> int:
    from ..bench.prediction import PredictionBenchConfig, run_prediction, summary

    try:
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        return fail("bench prediction", e)
    if args.dataset is not None and not args.dataset.is_file():
        return fail("bench prediction", f"--dataset {args.dataset}: no such file")
    try:
        report = run_prediction(PredictionBenchConfig(
            args.family_dir, args.dataset, args.split, args.domain, args.groups, args.edits,
            args.words, args.new_tokens, args.temperatures, args.source, args.seed, overrides))
    except ValueError as e:
        return fail("bench prediction", e)
    print(summary(report))
    write_json(args.json, report)
    return 0 if all(c["greedy_mismatches"] in (0, None) for c in report["cells"]) else 1
