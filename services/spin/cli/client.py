"""``spin generate``: a client of the router, streaming one completion."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .flags import fail, positive


def add_generate(sub: argparse._SubParsersAction) -> None:
    """``spin generate PROMPT``."""
    gen = sub.add_parser("generate", help="stream one completion from a running router")
    gen.add_argument("prompt")
    gen.add_argument("--endpoint", default="127.0.0.1:50051", help="the router (host:port)")
    gen.add_argument("--max-tokens", type=positive(int), default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--speculation", default="auto",
                     help="auto (the router's policy), off, or a drafter name")
    gen.add_argument("--k", type=int, default=0, help="k for a named drafter (0 = router's)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--prediction", default="", metavar="TEXT|@FILE",
                     help="Predicted Outputs: text the output is expected to repeat (@FILE: a "
                          "file's), drafted from by the `prediction` drafter")
    gen.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                     help="the router's API key (default: $SPIN_API_KEY)")
    gen.add_argument("--tls-ca", nargs="?", const="", metavar="PEM",
                     help="connect over TLS, trusting this CA certificate (alone: the system's)")
    gen.add_argument("--steps", action="store_true",
                     help="then print every verification step: drafter, k, accepted, ms, and "
                          "the policy's predicted ms")
    gen.set_defaults(func=_generate)


def _generate(args: argparse.Namespace) -> int:
    from ..client import GenerateArgs, generate

    if not args.prompt:
        return fail("generate", "the prompt is empty")
    prediction = args.prediction
    if prediction.startswith("@"):
        try:
            prediction = Path(prediction[1:]).read_text()
        except (OSError, UnicodeDecodeError) as e:
            return fail("generate", f"--prediction {args.prediction}: {e}")
    return generate(GenerateArgs(args.prompt, args.endpoint, args.max_tokens, args.temperature,
                                 args.top_p, args.top_k, args.seed, args.speculation, args.k,
                                 tuple(args.stop), args.steps, api_key=args.api_key,
                                 tls_ca=args.tls_ca, prediction=prediction))
