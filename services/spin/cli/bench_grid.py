"""``spin bench grid``, ``spin bench rates`` and ``spin bench dataset``: speculation auto against
off over concurrency x temperature x prompt length, and over arrival rates, and the long-prompt
dataset they time."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import (check_policy_overrides, fail, policy_overrides, positive, positive_ints,
                    temperatures, write_json)


def add_dataset(bsub: argparse._SubParsersAction) -> None:
    bd = bsub.add_parser("dataset", help="build the long-prompt dataset from text outside the "
                         "demo corpus (bench/unseen.py)")
    bd.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bd.add_argument("--per-domain", type=positive(int), default=60)
    bd.add_argument("--min-tokens", type=positive(int), default=200)
    bd.add_argument("--max-tokens", type=positive(int), default=320)
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument("--out", type=Path, default=None,
                    help="JSON Lines to write (default benchmarks/datasets/unseen-long.jsonl)")
    bd.set_defaults(func=_bench_dataset)


def _bench_dataset(args: argparse.Namespace) -> int:
    from ..bench.unseen import DEFAULT_OUT, UnseenConfig, build_unseen

    if args.min_tokens > args.max_tokens:
        return fail("bench dataset", f"--min-tokens {args.min_tokens} exceeds --max-tokens "
                    f"{args.max_tokens}")
    r = build_unseen(UnseenConfig(args.family_dir / "target", args.per_domain, args.min_tokens,
                                  args.max_tokens, args.seed, args.out or DEFAULT_OUT))
    print(f"{r['prompts']} prompts ({r['by_split']['tuning']} tuning, "
          f"{r['by_split']['evaluation']} evaluation), {r['mean_tokens']:.0f} tokens on average: "
          f"{r['out']}")
    return 0


def add_grid(bsub: argparse._SubParsersAction) -> None:
    bg = bsub.add_parser("grid", help="speculation auto vs off (and a fixed configuration) at "
                         "each concurrency x temperature x short/long prompts")
    bg.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bg.add_argument("--quick", action="store_true", help="fewer requests and tokens per cell")
    bg.add_argument("--concurrency", type=positive_ints, default=(1, 8, 32, 64),
                    help="comma-separated (default 1,8,32,64)")
    bg.add_argument("--temperatures", type=temperatures, default=(0.0, 0.8),
                    help="comma-separated (default 0,0.8; above 0 with top-p 0.95)")
    bg.add_argument("--prompts", default="short,long",
                    help="short (the demo's held-out prompts), long (--dataset), or both "
                         "(short,long; the default)")
    bg.add_argument("--dataset", type=Path, default=None,
                    help="the long prompts (JSON Lines; default benchmarks/datasets/"
                    "unseen-long.jsonl); only rows of the --split are timed")
    bg.add_argument("--split", choices=("evaluation", "tuning"), default="evaluation",
                    help="the prompts' half that is timed: tuning for runs that choose code or "
                    "constants, evaluation (default) for reported figures")
    bg.add_argument("--rounds", type=positive(int), default=2,
                    help="passes over each cell, the modes' order reversed every other pass "
                    "(default 2)")
    bg.add_argument("--repeat-off", action="store_true",
                    help="run speculation off twice per cell: the second run's ratio to the "
                         "first is the noise floor auto / off is read against")
    bg.add_argument("--fixed", default=None, metavar="DRAFTER:K",
                    help="a fixed configuration to compare too, chosen on the tuning split")
    bg.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings")
    bg.add_argument("--variant", action="append", default=[], metavar="LABEL=JSON",
                    help="auto with other learned-policy settings (JSON over --policy-config) "
                    "as a mode of its own, on a deployment of its own: a constant's candidates "
                    "side by side in one run (repeatable); its key \"deployment\": "
                    "{\"colocate\": [NAME, ...]} loads those drafters (or \"all\") inside the "
                    "verifier")
    bg.add_argument("--json", default=None, help="write the report here")
    bg.add_argument("--plot", type=Path, default=None, help="write auto / off per cell here (PNG)")
    bg.add_argument("--trace", type=Path, default=None, metavar="FILE",
                    help="auto's router's step trace (JSON Lines; each other mode's beside it, "
                    "its label added to the name: -off, -off-again), summarised at the end "
                    "(`spin bench trace`)")
    bg.add_argument("--suffix-decoding", action="store_true",
                    help="offer suffix decoding (off by default: the grid repeats its prompts, "
                    "and a store of their earlier outputs would draft them back)")
    bg.set_defaults(func=_bench_grid)


def add_trace(bsub: argparse._SubParsersAction) -> None:
    bt = bsub.add_parser("trace", help="a router's step trace (--step-trace) by kind of step: "
                         "tokens/s, predicted vs measured times and speculation's gain")
    bt.add_argument("file", type=Path)
    bt.add_argument("--json", default=None, help="write the summary here")
    bt.set_defaults(func=_bench_trace)


def _bench_trace(args: argparse.Namespace) -> int:
    from ..bench.trace_report import report_file, table

    if not args.file.is_file():
        return fail("bench trace", f"no trace at {args.file}")
    report = report_file(args.file)
    if not report["steps"]:
        return fail("bench trace", f"{args.file} has no steps")
    print(f"{report['steps']} steps")
    print(table(report))
    write_json(args.json, report)
    return 0



def _prompt_sets(text: str) -> tuple[str, ...] | None:
    """``--prompts``' sets (``both`` is short,long); None when it names something else."""
    given = "short,long" if text.strip() == "both" else text
    prompts = tuple(p.strip() for p in given.split(",") if p.strip())
    return prompts if prompts and not set(prompts) - {"short", "long"} else None


def add_rates(bsub: argparse._SubParsersAction) -> None:
    br = bsub.add_parser("rates", help="speculation auto vs off under Poisson arrivals, from "
                         "light load to twice off's capacity: mean latency per rate")
    br.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    br.add_argument("--fractions", default="0.25,0.5,1,1.5,2",
                    help="arrival rates as fractions of off's batched capacity (default "
                    "0.25,0.5,1,1.5,2)")
    br.add_argument("--requests", type=positive(int), default=32,
                    help="requests per rate (default 32)")
    br.add_argument("--temperatures", type=temperatures, default=(0.0, 0.8),
                    help="comma-separated (default 0,0.8; above 0 with top-p 0.95)")
    br.add_argument("--prompts", default="short,long", help="short, long or both (the default)")
    br.add_argument("--dataset", type=Path, default=None,
                    help="the long prompts (default benchmarks/datasets/unseen-long.jsonl)")
    br.add_argument("--split", choices=("evaluation", "tuning"), default="evaluation")
    br.add_argument("--repeat-off", action="store_true",
                    help="run speculation off twice: the noise floor of auto / off")
    br.add_argument("--seed", type=int, default=0)
    br.add_argument("--policy-config", default=None,
                    help="JSON overrides of the learned policy's settings")
    br.add_argument("--json", default=None, help="write the report here")
    br.add_argument("--trace", type=Path, default=None, metavar="FILE",
                    help="auto's router's step trace (JSON Lines; each other mode's beside it, "
                    "its label added to the name: -off, -off-again; `spin bench trace` "
                    "summarises it)")
    br.set_defaults(func=_bench_rates)


def _bench_rates(args: argparse.Namespace) -> int:
    from ..bench.grid import GridConfig
    from ..bench.rates import RatesConfig, run_rates, table
    from ..bench.unseen import DEFAULT_OUT

    prompts = _prompt_sets(args.prompts)
    try:
        fractions = tuple(float(x) for x in args.fractions.split(",") if x.strip())
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        return fail("bench rates", e)
    if prompts is None:
        return fail("bench rates", f"--prompts takes short, long or both, got {args.prompts!r}")
    if not fractions or min(fractions) <= 0:
        return fail("bench rates", f"--fractions wants numbers > 0, got {args.fractions!r}")
    grid = GridConfig(args.family_dir, temperatures=args.temperatures,
                      dataset=args.dataset or DEFAULT_OUT, prompt_sets=prompts,
                      split=args.split, repeat_off=args.repeat_off, seed=args.seed,
                      policy_config=overrides,
                      trace=args.trace.resolve() if args.trace else None)
    report = run_rates(RatesConfig(grid, fractions, args.requests))
    print(table(report))
    print(f"auto / off mean latency: max {report['max_auto_over_off_latency']:.3f}x, median "
          f"{report['median_auto_over_off_latency']:.3f}x; greedy outputs that differ from "
          f"off: {report['greedy_mismatches']}")
    write_json(args.json, report)
    return 0 if report["greedy_mismatches"] == 0 else 1


def grid_variants(specs: list[str], base: dict, fixed: tuple[str, int] | None
                  ) -> dict[str, dict]:
    """``--variant LABEL=JSON`` flags -> {label: overrides}, each checked over ``base`` (the
    ``--policy-config``); ValueError naming the bad one."""
    from ..bench.grid import DEPLOYMENT, OFF_AGAIN, deployment_options, merged

    taken = {"off", "auto", OFF_AGAIN} | ({f"{fixed[0]}:k{fixed[1]}"} if fixed else set())
    out: dict[str, dict] = {}
    for spec in specs:
        label, sep, text = spec.partition("=")
        label = label.strip()
        if not sep or not label:
            raise ValueError(f"--variant wants LABEL=JSON, got {spec!r}")
        if label in taken or label in out:
            raise ValueError(f"--variant label {label!r} is taken (off, auto, off again, "
                             "the fixed mode and each variant need their own)")
        try:
            variant = json.loads(text) if text.strip() else {}
            if not isinstance(variant, dict):
                raise ValueError(f"needs a JSON object, got {text!r}")
            options = deployment_options(variant)
            variant.pop(DEPLOYMENT, None)
            check_policy_overrides(merged(base, variant))
            out[label] = variant
            if options:
                out[label][DEPLOYMENT] = options
        except ValueError as e:
            raise ValueError(f"--variant {label}: {e}") from None
    return out


def _bench_grid(args: argparse.Namespace) -> int:
    from ..bench.grid import GridConfig, plot_grid, run_grid, table
    from ..bench.unseen import DEFAULT_OUT

    prompts = _prompt_sets(args.prompts)
    if prompts is None:
        return fail("bench grid", "--prompts takes short, long, short,long or both, got "
                    f"{args.prompts!r}")
    fixed = None
    if args.fixed is not None:
        name, _, k = args.fixed.rpartition(":")
        if not name or not k.isdigit() or int(k) <= 0:
            return fail("bench grid", f"--fixed wants DRAFTER:K with K > 0, got {args.fixed!r}")
        fixed = (name, int(k))
    try:
        overrides = policy_overrides(args.policy_config)
        variants = grid_variants(args.variant, overrides, fixed)
    except ValueError as e:
        return fail("bench grid", e)
    report = run_grid(GridConfig(args.family_dir, args.quick, args.concurrency,
                                 args.temperatures, dataset=args.dataset or DEFAULT_OUT,
                                 prompt_sets=prompts, fixed=fixed, split=args.split,
                                 rounds=args.rounds, repeat_off=args.repeat_off,
                                 policy_config=overrides,
                                 trace=args.trace.resolve() if args.trace else None,
                                 suffix_decoding=args.suffix_decoding, variants=variants))
    print(table(report))
    print(f"auto / off: min {report['min_auto_over_off']:.3f}x, median "
          f"{report['median_auto_over_off']:.3f}x; greedy outputs that differ from off: "
          f"{report['greedy_mismatches']}")
    if "off_again_over_off_range" in report:
        lo, hi = report["off_again_over_off_range"]
        print(f"noise floor, off again / off: {lo:.3f}x to {hi:.3f}x")
    write_json(args.json, report)
    if args.plot is not None:
        plot_grid(report, args.plot)
    if args.trace is not None:
        from ..bench.trace_report import report_file, table as trace_table
        print(trace_table(report_file(args.trace)))
    return 0 if report["greedy_mismatches"] == 0 else 1
