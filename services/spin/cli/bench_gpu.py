"""``spin bench gpu``: the CUDA path measured on one accelerator (``bench/gpu.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .flags import DTYPES, device, fail, positive

LOSSLESS_BARS = ("e2e_greedy_mismatches", "demo_spin_mismatches", "services_lossless")
"""Bars that are correctness, not speed: missing one is a failure (exit status 1)."""


def _parts(text: str) -> tuple[str, ...]:
    from ..bench.gpu_config import parse_parts

    try:
        return parse_parts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_gpu(bsub: argparse._SubParsersAction) -> None:
    """``spin bench gpu``."""
    bg = bsub.add_parser("gpu", help="the CUDA path on one accelerator: an 8B-shape target "
                         "against the HBM limit, verification and drafter step times with CUDA "
                         "graphs on and off, transformers' baselines, the demo family end to "
                         "end; exit 1 if a part fails or an output differs, 2 if only a speed "
                         "bar is missed")
    bg.add_argument("--quick", action="store_true",
                    help="tiny shapes, few tokens and repetitions; without --parts the parts "
                         "that start no services (well under a minute on 2 CPU cores)")
    bg.add_argument("--json", type=Path, help="write the report here (after every part)")
    bg.add_argument("--device", type=device, default="auto", help="auto, cpu, cuda or cuda:N")
    bg.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="auto: bfloat16 on CUDA (the demo family: its checkpoints' dtype), "
                         "float32 on the CPU")
    bg.add_argument("--parts", type=_parts, default=None,
                    help="comma-separated, from target,verify,baselines,e2e,services,drafters "
                         "(default: all)")
    bg.add_argument("--budget", type=positive(float), default=250.0, metavar="SECONDS",
                    help="the whole run's time: parts that would start past it are skipped, "
                         "and each part has its own smaller budget")
    bg.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    bg.set_defaults(func=_bench_gpu)


def _bench_gpu(args: argparse.Namespace) -> int:
    from ..bench.gpu import run_gpu_bench
    from ..bench.gpu_config import GpuBenchConfig
    from ..bench.gpu_report import table

    try:
        cfg = GpuBenchConfig(quick=args.quick, device=args.device, dtype=args.dtype,
                             parts=args.parts, budget_s=args.budget, family_dir=args.family_dir,
                             json_path=args.json)
        report = run_gpu_bench(cfg, say=lambda line: print(line, flush=True))
    except ValueError as e:  # no such device, a dtype it cannot run: a failure, not a bar (2)
        fail("bench gpu", e)
        return 1
    print(table(report), flush=True)
    if args.json:
        print(f"wrote {args.json}")
    failed = [n for n, p in report["parts"].items() if p["status"] == "error"]
    failed += [n for n in LOSSLESS_BARS if report["bars"][n]["ok"] is False]
    if failed:
        return 1
    return 2 if any(b["ok"] is False for b in report["bars"].values()) else 0
