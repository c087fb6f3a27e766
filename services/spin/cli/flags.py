"""Flags shared by several ``spin`` subcommands.

``model_flags``/``runner_config``: where a model runs and how much KV cache it gets
(``RunnerConfig``); ``service_flags``/``server_config``: where a service listens
(``ServerConfig``) and the cores it runs on. ``spin serve`` writes such flags for its verifier
and drafters (``serve.runner_argv``, ``serve.server_argv``: the tests check that they parse back
here to equal configs).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the modules behind these import torch and grpc: not for `spin --help`
    from ..engine.model_runner import RunnerConfig
    from ..rpc.serving import ServerConfig


# ---- argument types -----------------------------------------------------------------------------

def positive(kind: type) -> Callable[[str], Any]:
    """An argument type: ``kind(text)``, which must be > 0."""
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    return parse


def positive_ints(text: str) -> tuple[int, ...]:
    """An argument type: comma-separated integers, each > 0 (e.g. concurrencies)."""
    out = tuple(positive(int)(x) for x in text.split(",") if x.strip())
    if not out:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}")
    return out


def temperatures(text: str) -> tuple[float, ...]:
    """An argument type: comma-separated sampling temperatures, each in [0, 2]."""
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from None
    if not out or any(not 0.0 <= t <= 2.0 for t in out):
        raise argparse.ArgumentTypeError(f"temperatures must be in [0, 2], got {text!r}")
    return out


def size(text: str) -> int:
    """An argument type: a memory size (``64MiB``, ``20GiB``, bytes) in bytes."""
    from ..engine.memory import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def fraction(text: str) -> float:
    """An argument type: a float in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def device(text: str) -> str:
    """An argument type: auto, cpu, cuda or cuda:N."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def cpu_list(text: str) -> list[int]:
    """An argument type: cores such as ``1`` or ``0,2-3`` (``cpus.parse_cpus``)."""
    from ..cpus import parse_cpus

    try:
        return parse_cpus(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


DTYPES = ("auto", "float32", "bfloat16", "float16")
"""The ``--dtype`` choices."""


# ---- the model: RunnerConfig --------------------------------------------------------------------

def model_flags(p: argparse.ArgumentParser) -> None:
    """Where a model runs and how much KV cache it gets (verifier, drafter, serve, plan)."""
    p.add_argument("--device", type=device, default="auto",
                   help="auto (CUDA when present), cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="weights and KV cache (auto: float32 on the CPU, the checkpoint's on CUDA)")
    p.add_argument("--kv-cache-memory", type=size, metavar="SIZE",
                   help="KV cache budget, e.g. 64MiB or 20GiB (default: 512MiB on the CPU; on "
                        "CUDA what --gpu-memory-utilization leaves after weights and activations)")
    p.add_argument("--gpu-memory-utilization", type=fraction, default=0.9, metavar="F",
                   help="share of the GPU this process may use (CUDA; default 0.9)")
    p.add_argument("--max-model-len", type=positive(int), metavar="N",
                   help="longest request, prompt + output (default: the model's context, or what "
                        "the KV cache holds if that is less); longer requests are refused")
    p.add_argument("--max-seqs", "--slots", dest="max_seqs", type=positive(int), default=64,
                   help="requests held at once (no memory is set aside for them)")
    p.add_argument("--block-size", type=positive(int), default=16, help="tokens per KV block")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="on CUDA, replay decode and verification steps as CUDA graphs captured "
                        "at start per shape bucket (default on; ignored on the CPU)")
    p.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa",
                   help="sdpa: keys gathered through the block tables, a dense mask (default); "
                        "flex: FlexAttention over the paged pool with a block mask from the "
                        "block tables and the token tree (compiled on CUDA)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                   help="torch.compile the bucketed steps (inductor; default off: on the CPU each "
                        "bucket compiles for seconds)")
    p.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share full KV blocks of identical context prefixes across requests and "
                        "keep them after a request ends, until their blocks are needed "
                        "(default on)")


def quantize_flag(p: argparse.ArgumentParser) -> None:
    """``--quantize``: the drafter's weights (the one ``RunnerConfig`` field only a drafter
    takes: the target's weights stay as they are, or its output would change)."""
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="int8: int8 weights on CPU (faster drafts; the output is the "
                        "target's either way, the acceptance rate may change)")


def runner_config(args: argparse.Namespace) -> RunnerConfig:
    """The ``RunnerConfig`` of ``model_flags`` (and ``--quantize``, where the parser has it)."""
    from ..engine.model_runner import RunnerConfig

    return RunnerConfig(device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        max_model_len=args.max_model_len, max_seqs=args.max_seqs,
                        block_size=args.block_size, quantize=getattr(args, "quantize", "none"),
                        cuda_graphs=args.cuda_graphs, compile=args.compile,
                        attention=args.attention, prefix_caching=args.prefix_caching)


# ---- the service: ServerConfig and --cpus -------------------------------------------------------

def service_flags(p: argparse.ArgumentParser, port: int) -> None:
    """Where a service (verifier, drafter, router) listens, how it stops, its cores."""
    p.add_argument("--host", default="127.0.0.1", help="interface (0.0.0.0 in a container)")
    p.add_argument("--port", type=int, default=port, help="gRPC port (0 = a free one)")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="Prometheus port (0 = a free one; default: none)")
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    p.add_argument("--cpus", type=cpu_list, metavar="LIST",
                   help="run on these cores only, e.g. 1 or 0,2-3 (Linux; default: all)")
    p.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", metavar="PEM",
                   help="serve TLS with this certificate chain (with --tls-key)")
    p.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", metavar="PEM",
                   help="the private key of --tls-cert")


def server_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` of ``service_flags`` (``--cpus`` is ``args.cpus``)."""
    from ..rpc.serving import ServerConfig

    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    return ServerConfig(host=args.host, port=args.port, metrics_port=args.metrics_port,
                        grace_s=args.grace, tls_cert=args.tls_cert, tls_key=args.tls_key)


def place(args: argparse.Namespace) -> None:
    """Pin the process to ``--cpus``, if given (before it starts threads of its own)."""
    from ..cpus import pin

    if args.cpus is not None:
        pin(args.cpus)


def threads(args: argparse.Namespace) -> None:
    """Pin the process to ``--cpus`` (if given), then set torch's threads: ``--threads``, else
    one per pinned core."""
    import torch

    place(args)
    n = args.threads or len(args.cpus or ())
    if n:
        torch.set_num_threads(n)


def service_logging() -> None:
    """A service's log lines (it says what it runs)."""
    import logging

    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# ---- values of several commands -----------------------------------------------------------------

def policy_overrides(text: str | None) -> dict:
    """The JSON object of ``--policy-config``, checked against the learned policy's settings
    (ValueError naming what is wrong)."""
    if not text:
        return {}
    try:
        overrides = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"needs a JSON object, got {text!r}")
    check_policy_overrides(overrides)
    return overrides


def check_policy_overrides(overrides: dict) -> None:
    """ValueError naming a learned-policy setting or value ``overrides`` gets wrong."""
    from ..policy.learned import LearnedPolicy, learned_config

    LearnedPolicy(learned_config(overrides))


def named_models(specs: list[str], what: str) -> dict[str, str]:
    """NAME=PATH_OR_NAME flags -> {name: checkpoint} (ValueError naming the bad one)."""
    out = {}
    for spec in specs:
        name, sep, model = spec.partition("=")
        if not sep or not name or not model:
            raise ValueError(f"{what} wants NAME=PATH_OR_NAME, got {spec!r}")
        out[name] = model
    return out


def fail(command: str, message: object) -> int:
    """Print ``spin <command>: <message>`` to stderr; the exit status of bad input (2)."""
    print(f"spin {command}: {message}", file=sys.stderr)
    return 2


def write_json(path: str | None, report: dict) -> None:
    """Write a command's report as JSON to ``path`` (if given) and say so."""
    if path:
        Path(path).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {path}")
