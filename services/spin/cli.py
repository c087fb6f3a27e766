"""The ``spin`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .zoo.specs import BUILD_DIR, FAMILY_DIR


def _zoo_train(args: argparse.Namespace) -> int:
    from .zoo.build import STAGES, build_family
    from .zoo.specs import DEMO_FAMILY, scaled

    stages = tuple(args.stages.split(",")) if args.stages else STAGES
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        print(f"spin zoo train: unknown stages {unknown}; expected some of {list(STAGES)}",
              file=sys.stderr)
        return 2
    family = scaled(DEMO_FAMILY, args.scale) if args.scale != 1.0 else DEMO_FAMILY
    build_family(family, args.family_dir, args.build_dir, stages=stages, force=args.force)
    return 0


def _zoo_report(args: argparse.Namespace) -> int:
    from .zoo.report import ReportConfig, markdown, run_report, update_readme

    cfg = ReportConfig(family_dir=args.family_dir, prompts_per_domain=args.prompts, k=args.k,
                       new_tokens=args.new_tokens)
    report = run_report(cfg)
    table = markdown(report)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    if args.readme:
        update_readme(Path(args.readme), table)
        print(f"updated {args.readme}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .zoo.demo import generate

    try:
        generate(args.model_dir, args.prompt, args.max_tokens, args.temperature, args.seed)
    except ValueError as e:
        print(f"spin generate: {e}", file=sys.stderr)
        return 2
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .zoo.demo import demo

    demo(args.family_dir, max_tokens=args.max_tokens)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from .bench.engine import EngineBenchConfig, run_engine_bench

    report = run_engine_bench(EngineBenchConfig(family_dir=args.family_dir, quick=args.quick))
    for domain, row in report["domains"].items():
        alone = row["target_alone_tok_s"]
        print(f"{domain:6s} target alone {alone:7.1f} tok/s | HF generate "
              f"{row['hf_generate_tok_s']:7.1f} | HF assisted best {row['hf_assisted_best_tok_s']:7.1f} "
              f"({row['hf_assisted_best_draft']}) | spec best {row['spec_best_tok_s']:7.1f} "
              f"({row['spec_best_drafter']}, k={row['spec_best_k']}, tau={row['tau']:.2f}) "
              f"= {row['spec_best_tok_s'] / alone:.2f}x alone, "
              f"{row['spec_best_tok_s'] / row['hf_generate_tok_s']:.2f}x HF generate, "
              f"{row['spec_best_tok_s'] / row['hf_assisted_best_tok_s']:.2f}x HF assisted")
    for b, row in report["batch"].items():
        print(f"batch {b:>2s}: spec off {row['spec_off_tok_s']:7.1f} tok/s, on "
              f"{row['spec_on_tok_s']:7.1f} tok/s ({row['spec_on_tok_s'] / row['spec_off_tok_s']:.2f}x)")
    print(f"efficiency at batch 1: {report['efficiency_b1']:.2f}; lossless: {report['lossless']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0 if report["lossless"] else 1


def _positive(kind: type) -> callable:
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spin", description="SPIN serving: speculative decoding with "
                                "a pool of heterogeneous draft models.")
    sub = p.add_subparsers(dest="command", required=True)

    zoo = sub.add_parser("zoo", help="the demo model family: build it, measure it")
    zsub = zoo.add_subparsers(dest="zoo_command", required=True)
    train = zsub.add_parser("train", help="rebuild corpus, tokenizer and every model from scratch")
    train.add_argument("--stages", help="comma-separated subset of: corpus,tokenizer,target,"
                       "distill,drafts,prompts (default: all)")
    train.add_argument("--force", action="store_true", help="redo stages whose output exists")
    train.add_argument("--scale", type=_positive(float), default=1.0,
                       help="multiply every token budget (0.01 for a smoke run)")
    train.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    train.add_argument("--build-dir", type=Path, default=BUILD_DIR)
    train.set_defaults(func=_zoo_train)

    report = zsub.add_parser("report", help="measured acceptance table and forward costs")
    report.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    report.add_argument("--prompts", type=_positive(int), default=16, help="prompts per domain")
    report.add_argument("--k", type=_positive(int), default=4, help="speculation length")
    report.add_argument("--new-tokens", type=_positive(int), default=128)
    report.add_argument("--json", help="write the full report as JSON to this file")
    report.add_argument("--readme", help="replace the report section of this README")
    report.set_defaults(func=_zoo_report)

    gen = sub.add_parser("generate", help="stream a generation from one model")
    gen.add_argument("prompt")
    gen.add_argument("--model-dir", type=Path, default=FAMILY_DIR / "target")
    gen.add_argument("--max-tokens", type=_positive(int), default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int)
    gen.set_defaults(func=_generate)

    bench = sub.add_parser("bench", help="benchmarks, measured side by side in one run")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    be = bsub.add_parser("engine", help="engine vs transformers, speculation on vs off")
    be.add_argument("--quick", action="store_true", help="fewer prompts and k (<= 4 min on 2 cores)")
    be.add_argument("--json", help="write the report as JSON to this file")
    be.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    be.set_defaults(func=_bench_engine)

    demo = sub.add_parser("demo", help="the family on held-out prompts, with per-drafter acceptance")
    demo.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    demo.add_argument("--max-tokens", type=_positive(int), default=96)
    demo.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if getattr(args, "temperature", 0.0) < 0:
        parser().error("--temperature must be >= 0")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
