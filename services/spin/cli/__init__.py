"""The ``spin`` command line: the top-level parser and ``main``.

Each command group has a module that builds its subcommands' parsers and runs them:
``zoo`` (``spin zoo``, ``spin demo``), ``client`` (``spin generate``), ``services`` (``spin
verifier|drafter|router``), ``serve``, ``plan``, ``bench``, ``stats`` and ``profile``; flags shared
by several live in ``flags``.
"""

from __future__ import annotations

import argparse

from . import bench, client, plan, profile, serve, services, stats, zoo


def parser() -> argparse.ArgumentParser:
    """``spin`` with every subcommand."""
    p = argparse.ArgumentParser(prog="spin", description="SPIN serving: speculative decoding with "
                                "a pool of heterogeneous draft models.")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (zoo.add_zoo, client.add_generate, services.add_verifier, services.add_drafter,
                services.add_router, serve.add_serve, plan.add_plan, bench.add_bench,
                stats.add_stats, profile.add_profile, zoo.add_demo):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``spin`` with ``argv`` (default: the process's); the exit status."""
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "temperature", 0.0) < 0:
        p.error("--temperature must be >= 0")
    return args.func(args)

