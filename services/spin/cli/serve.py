"""``spin serve``: the whole system on this machine (``spin.serve``), or its memory plan."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..router.config import RouterConfig, SchedulerConfig, unknown_default_drafter
from ..zoo.specs import FAMILY_DIR
from .flags import fail, model_flags, named_models, policy_overrides, positive, runner_config, size
from .services import default_drafter, suffix_flags

if TYPE_CHECKING:
    from ..serve import ServeConfig


def add_serve(sub: argparse._SubParsersAction) -> None:
    """``spin serve`` (``serve_config`` reads its flags)."""
    sv = sub.add_parser("serve", help="the whole system on this machine (the embedded default)")
    sv.add_argument("--family-dir", type=Path, default=FAMILY_DIR)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=50051)
    sv.add_argument("--metrics-port", type=int, default=0)
    sv.add_argument("--http-port", type=int, help="the OpenAI-compatible HTTP API's port "
                    "(default 8000; a free one with --port 0)")
    sv.add_argument("--no-http", action="store_true", help="serve no HTTP API")
    sv.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                    help="clients must send it (HTTP: 'Authorization: Bearer KEY'; gRPC: the "
                    "same 'authorization' metadata); default: $SPIN_API_KEY, else no key")
    sv.add_argument("--tls-cert", "--ssl-certfile", dest="tls_cert", metavar="PEM",
                    help="serve gRPC and HTTP over TLS with this certificate chain")
    sv.add_argument("--tls-key", "--ssl-keyfile", dest="tls_key", metavar="PEM",
                    help="the private key of --tls-cert")
    sv.add_argument("--chat-template", metavar="FILE",
                    help="a Jinja chat template for /v1/chat/completions (default: the "
                    "tokenizer's)")
    sv.add_argument("--drafters", help="comma-separated draft models (default: all)")
    sv.add_argument("--default-drafter", default=PROMPT_LOOKUP)
    sv.add_argument("--default-k", type=positive(int), default=4)
    sv.add_argument("--max-batch", type=positive(int), default=32)
    sv.add_argument("--max-queue", type=positive(int), default=256)
    suffix_flags(sv)
    sv.add_argument("--no-redis", action="store_true", help="keep statistics in the router")
    sv.add_argument("--log-dir", type=Path, help="the services' logs, Redis's data and the "
                    "statistics kept at shutdown (default: build/serve)")
    sv.add_argument("--max-restarts", type=int, default=5, metavar="N",
                    help="restarts of one service (drafter, verifier, router, redis-server) "
                         "within 5 minutes before spin serve gives up (0: never restart)")
    sv.add_argument("--verifier-outage", type=positive(float), default=30.0, metavar="SECONDS",
                    help="how long running requests wait for a verifier that is down (e.g. "
                         "being restarted) before they fail with UNAVAILABLE")
    sv.add_argument("--drafter-quantize", choices=("auto", "none", "int8"), default="auto",
                    help="the draft models' weights: int8 drafts faster on CPU, and the output is "
                         "the target's either way (int8 needs --device cpu and --dtype float32; "
                         "auto: int8 there when this torch has the kernels, else none)")
    sv.add_argument("--micro-batches", type=positive(int), default=1,
                    help="micro-batches in flight in the router (2 = pipelined)")
    sv.add_argument("--plain-steps", type=positive(int), default=4,
                    help="plain decoding steps per verifier call for requests with speculation "
                         "off (1: a call per token)")
    sv.add_argument("--step-trace", metavar="FILE",
                    help="the router appends every verified step to FILE as a JSON line")
    sv.add_argument("--cpus", choices=("shared", "split"), default="shared",
                    help="split: the verifier on cores of its own, the drafters and the router "
                         "on the others (for --micro-batches 2 on a CPU-only machine: drafting "
                         "and verification then run at once without slowing each other)")
    sv.add_argument("--policy", choices=("learned", "fixed"), default="learned",
                    help="the router's policy (learned profiles the machine on first start)")
    sv.add_argument("--policy-config", help="JSON overrides of the learned policy's settings "
                    "(see `spin router --help`)")
    sv.add_argument("--target", help="the target: a checkpoint directory or a Hugging Face name "
                    "in the local cache (default: the demo family's target)")
    sv.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH_OR_NAME",
                    help="a draft model (repeatable; default: the demo family's draft models)")
    sv.add_argument("--head", action="append", default=[], metavar="NAME=PATH",
                    help="an EAGLE-3 draft head served inside the verifier (repeatable; "
                         "default: the demo family's heads)")
    sv.add_argument("--no-heads", action="store_true", help="serve no draft head")
    sv.add_argument("--colocate", action="append", default=[], metavar="NAME",
                    help="load draft model NAME inside the verifier instead of as a service of "
                         "its own (it drafts in the verifier's call: one round trip a step "
                         "fewer); repeatable, 'all' for every draft model")
    model_flags(sv)
    sv.add_argument("--drafter-kv-cache-memory", type=size, metavar="SIZE",
                    help="each drafter's KV cache budget (default: its device's default: "
                         "512MiB on the CPU, its share of the GPU on CUDA)")
    sv.add_argument("--step-times", choices=("auto", "measure", "off"), default="auto",
                    help="each service's step times at start, which the router fits its cost "
                         "model from (auto: from the cache of an earlier start, else measured; "
                         "off: none, enough for --policy fixed)")
    sv.add_argument("--dry-run", action="store_true",
                    help="print what each service would load and hold (weights, KV bytes per "
                         "token, blocks, concurrent tokens), then exit (1 if one cannot fit)")
    sv.add_argument("--gpu-memory", type=size, metavar="SIZE",
                    help="with --dry-run: the GPU's memory, e.g. 80GiB (to plan CUDA here)")
    sv.set_defaults(func=_serve)


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The ``ServeConfig`` of ``spin serve``'s flags; ValueError saying which is wrong."""
    from ..serve import ServeConfig
    from ..supervisor import RestartPolicy

    overrides = policy_overrides(args.policy_config)
    drafter_models = named_models(args.drafter, "--drafter") if args.drafter else None
    heads = {} if args.no_heads else (named_models(args.head, "--head") if args.head else None)
    router = RouterConfig(default_drafter=default_drafter(args.default_drafter),
                          default_k=args.default_k, policy=args.policy, policy_config=overrides,
                          http_port=None if args.no_http else 8000,
                          api_key=args.api_key or None, chat_template=args.chat_template,
                          scheduler=SchedulerConfig(max_batch=args.max_batch,
                                                    max_queue=args.max_queue,
                                                    micro_batches=args.micro_batches,
                                                    plain_steps=args.plain_steps,
                                                    step_trace=(str(Path(args.step_trace).resolve())
                                                                if args.step_trace else None),
                                                    verifier_outage_s=args.verifier_outage,
                                                    suffix_decoding=not args.no_suffix_decoding,
                                                    suffix_store_tokens=args.suffix_store_tokens,
                                                    suffix_share=args.suffix_share,
                                                    suffix_share_entries=args
                                                    .suffix_share_entries,
                                                    grammar_drafts=not args.no_grammar_drafts,
                                                    predicted_outputs=not
                                                    args.no_predicted_outputs))
    if args.suffix_share and args.no_redis:
        raise ValueError("--suffix-share shares through Redis: leave out --no-redis")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("--tls-cert and --tls-key go together")
    for flag, path in (("--chat-template", args.chat_template), ("--tls-cert", args.tls_cert),
                       ("--tls-key", args.tls_key)):
        if path and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    return ServeConfig(family_dir=args.family_dir, host=args.host, port=args.port,
                       metrics_port=args.metrics_port,
                       drafters=args.drafters.split(",") if args.drafters else None,
                       router=router, redis=not args.no_redis, cpus=args.cpus,
                       drafter_quantize=args.drafter_quantize, target=args.target,
                       drafter_models=drafter_models, heads=heads,
                       colocate=tuple(args.colocate),
                       runner=runner_config(args),
                       drafter_kv_cache_memory=args.drafter_kv_cache_memory,
                       step_times=args.step_times,
                       restart=RestartPolicy(max_restarts=args.max_restarts),
                       http_port=args.http_port, tls_cert=args.tls_cert, tls_key=args.tls_key,
                       **({"log_dir": args.log_dir} if args.log_dir else {}))


def _serve(args: argparse.Namespace) -> int:
    try:
        cfg = serve_config(args)
        _check_default_drafter(cfg)
        if args.dry_run:
            from ..plan import plan_serve

            return plan_serve(cfg, args.gpu_memory)
        from ..serve import drafter_quantization

        drafter_quantization(cfg)  # refused here, before any child starts
    except ValueError as e:
        return fail("serve", e)
    return _run(cfg)


def _check_default_drafter(cfg: ServeConfig) -> None:
    """ValueError for a ``--default-drafter`` that nothing served is named (the drafter services,
    the drafters inside the verifier, the model-free ones), before any child starts."""
    from ..serve import models, served_heads

    drafters = models(cfg)[1]  # each a service or inside the verifier (--colocate)
    problem = unknown_default_drafter(replace(cfg.router, drafters=dict.fromkeys(drafters, "")),
                                      list(served_heads(cfg)))
    if problem:
        raise ValueError(problem)


def _run(cfg: ServeConfig) -> int:
    """Start everything, print the endpoint, wait for Ctrl-C or SIGTERM."""
    from ..serve import Embedded
    from ..supervisor import Supervisor

    stop = threading.Event()
    emb = Embedded(cfg)

    def on_signal(*_) -> None:  # installed for SIGINT too: it may arrive ignored (nohup, &)
        started = stop.is_set() or emb.router is not None
        stop.set()
        if not started:
            raise KeyboardInterrupt  # abort a start in progress

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    print(f"starting the verifier, drafters and router (logs in {cfg.log_dir}) ...", flush=True)
    try:
        try:
            emb.start()
        except RuntimeError as e:  # a child exited while starting: its log's end says why
            print(f"spin serve: {e}", file=sys.stderr, flush=True)
            return 1
        print(f"SPIN serving on {emb.endpoint} (gRPC spin.v1.Generation); router metrics on "
              f"http://127.0.0.1:{emb.router.metrics_port}/metrics", flush=True)
        if emb.router.http_port:
            scheme = "https" if cfg.tls_cert else "http"
            print(f"OpenAI-compatible API on {scheme}://{cfg.host}:{emb.router.http_port}/v1 "
                  f"(POST /v1/completions, /v1/chat/completions; GET /v1/models)", flush=True)
        for c in emb.children:
            print(f"  {c.role:24s} 127.0.0.1:{c.port}  metrics :{c.metrics_port}  "
                  f"pid {c.proc.pid}", flush=True)
        if emb.redis is not None:
            print(f"  {'redis-server':24s} 127.0.0.1:{emb.redis.port}  pid {emb.redis.pid}",
                  flush=True)
        print(f'try: spin generate "def parse(path):" --endpoint {emb.endpoint}   (Ctrl-C stops)',
              flush=True)
        supervisor = Supervisor(emb, cfg.restart, out=lambda line: print(line, file=sys.stderr,
                                                                         flush=True))
        while not stop.wait(0.5):
            fatal = supervisor.check()
            if fatal:
                print(fatal, file=sys.stderr, flush=True)
                return 1
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping ...", flush=True)
        emb.stop()
    return 0
