"""``spin plan``: the memory plan of a deployment, from model configs alone."""

from __future__ import annotations

import argparse

from .flags import fail, model_flags, named_models, runner_config, size


def add_plan(sub: argparse._SubParsersAction) -> None:
    """``spin plan --target ... --drafter NAME=...``."""
    pl = sub.add_parser("plan", help="memory plan of a deployment: per service its weights, KV "
                        "bytes per token, blocks and concurrent tokens (reads configs only)")
    pl.add_argument("--target", required=True, help="the target: checkpoint directory or name")
    pl.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model (repeatable)")
    model_flags(pl)
    pl.add_argument("--drafter-kv-cache-memory", type=size, metavar="SIZE",
                    help="each drafter's KV cache budget (default: its device's default)")
    pl.add_argument("--gpu-memory", type=size, metavar="SIZE",
                    help="memory of one GPU, e.g. 80GiB (CUDA plans without a GPU here)")
    pl.add_argument("--json", help="write the plan as JSON to this file")
    pl.set_defaults(func=_plan)


def _plan(args: argparse.Namespace) -> int:
    from ..plan import plan_command

    try:
        drafter_models = named_models(args.drafter, "--drafter")
    except ValueError as e:
        return fail("plan", e)
    return plan_command(args.target, drafter_models, runner_config(args),
                        args.drafter_kv_cache_memory, args.gpu_memory, args.json)
