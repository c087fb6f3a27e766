"""``spin profile``: measure step times, fit the cost model the learned policy plans with."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..zoo.specs import BUILD_DIR, FAMILY_DIR
from .flags import DTYPES, device, fail, named_models


def add_profile(sub: argparse._SubParsersAction) -> None:
    """``spin profile``."""
    pr = sub.add_parser("profile", help="measure step times and fit the cost model")
    pr.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    pr.add_argument("--quick", action="store_true", help="a smaller grid (about a minute)")
    pr.add_argument("--drafters", help="comma-separated draft models (default: all)")
    pr.add_argument("--out", type=Path, default=BUILD_DIR.parent / "cost_model.json")
    pr.add_argument("--threads", type=int, default=0,
                    help="torch threads when timing verification, as the verifier serves (0 = default)")
    pr.add_argument("--drafter-threads", type=int, default=0,
                    help="torch threads when timing drafters, as each drafter serves (0 = default)")
    pr.add_argument("--drafter-quantize", choices=("none", "int8"), default="none",
                    help="the draft models' weights, as the drafters serve them")
    pr.add_argument("--target", help="the target's checkpoint (default: the family's)")
    pr.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model to profile (repeatable; default: the family's)")
    pr.add_argument("--device", type=device, default="auto", help="as the services run")
    pr.add_argument("--dtype", choices=DTYPES, default="auto", help="as the services run")
    pr.set_defaults(func=_profile)


def _profile(args: argparse.Namespace) -> int:
    from ..bench.profile import ProfileConfig, run_profile
    from ..engine.model_runner import RunnerConfig

    try:
        drafter_models = named_models(args.drafter, "--drafter") if args.drafter else None
    except ValueError as e:
        return fail("profile", e)
    r = run_profile(ProfileConfig(family_dir=args.family_dir, quick=args.quick, out=args.out,
                                  drafters=args.drafters.split(",") if args.drafters else None,
                                  threads=args.threads, drafter_threads=args.drafter_threads,
                                  drafter_quantize=args.drafter_quantize, target=args.target,
                                  drafter_models=drafter_models,
                                  runner=RunnerConfig(device=args.device, dtype=args.dtype)))
    print(f"wrote {r['out']} ({r['verify_points']} verify and {r['draft_points']} draft points)")
    print("fit error (MAPE): " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in r["mape"].items()))
    print("batch size -> k at acceptance 0.7: " + ", ".join(
        f"{b}: {k}" for b, k in r["k_table_at_acceptance_0.7"].items()))
    return 0
