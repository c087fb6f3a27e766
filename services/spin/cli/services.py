"""``spin verifier``, ``spin drafter`` and ``spin router``: the gRPC services, one process each.

``router_config`` builds the router's ``RouterConfig`` from its flags and ``router_argv`` writes
one back to them, its exact inverse (``spin serve`` starts its router child with it).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import fields
from pathlib import Path

from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..router.config import RouterConfig, SchedulerConfig
from ..router.discovery import KubernetesDiscoveryConfig
from .flags import (fail, model_flags, place, policy_overrides, positive, quantize_flag,
                    runner_config, server_config, service_flags, service_logging, threads)

NO_DRAFTER = ("", "none", "off")
"""``--default-drafter`` values meaning no speculation (``RouterConfig.default_drafter`` None)."""


def default_drafter(text: str) -> str | None:
    """A ``--default-drafter`` value as ``RouterConfig.default_drafter`` holds it."""
    return None if text in NO_DRAFTER else text


# ---- verifier and drafter -----------------------------------------------------------------------

def _service(sub: argparse._SubParsersAction, name: str, help: str,
             port: int) -> argparse.ArgumentParser:
    sp = sub.add_parser(name, help=help)
    service_flags(sp, port)
    return sp


def _step_times(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--step-times", choices=("auto", "measure", "off"), default="auto",
                    help="measure this service's step times at start and report them to the "
                         "routers, which fit their cost model from them (auto: load them from the "
                         "cache of an earlier start when there is one; off: report none)")


def add_verifier(sub: argparse._SubParsersAction) -> None:
    """``spin verifier``: the target model as a service."""
    sp = _service(sub, "verifier", "the verifier service (target model)", 50061)
    sp.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    model_flags(sp)
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    sp.add_argument("--no-decompose", action="store_true",
                    help="one forward per batch (no splitting into sub-batches)")
    _step_times(sp)
    sp.set_defaults(func=_verifier)


def add_drafter(sub: argparse._SubParsersAction) -> None:
    """``spin drafter``: one draft model as a service."""
    sp = _service(sub, "drafter", "the drafter service (draft model)", 50071)
    sp.add_argument("--model", type=Path, required=True, help="checkpoint directory")
    model_flags(sp)
    sp.add_argument("--threads", type=int, default=0, help="torch threads (0 = default)")
    sp.add_argument("--name", help="drafter name (default: the directory name)")
    quantize_flag(sp)
    _step_times(sp)
    sp.set_defaults(func=_drafter)


def _verifier(args: argparse.Namespace) -> int:
    from ..verifier.server import run

    service_logging()
    threads(args)
    try:
        run(str(args.model), server_config(args), runner_config(args),
            decompose=not args.no_decompose, step_times=args.step_times)
    except ValueError as e:  # a device, dtype or memory budget that cannot work
        return fail("verifier", e)
    return 0


def _drafter(args: argparse.Namespace) -> int:
    from ..drafter.server import run

    service_logging()
    threads(args)
    try:
        run(str(args.model), args.name, server_config(args), runner_config(args),
            step_times=args.step_times)
    except ValueError as e:
        return fail("drafter", e)
    return 0


# ---- router -------------------------------------------------------------------------------------

def add_router(sub: argparse._SubParsersAction) -> None:
    """``spin router``: the client-facing router (``router_config`` reads its flags)."""
    rt = _service(sub, "router", "the client-facing router", 50051)
    rt.add_argument("--verifier", help="verifier address host:port (static discovery)")
    rt.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                    help="static: --verifier/--drafter addresses; kubernetes: watch EndpointSlices "
                    "of the drafter and verifier Services (labels spin.dev/role, spin.dev/drafter)")
    rt.add_argument("--label-selector",
                    help="kubernetes discovery: EndpointSlices of this release, e.g. "
                    "app.kubernetes.io/instance=spin")
    rt.add_argument("--namespace", help="kubernetes discovery: namespace (default: $POD_NAMESPACE)")
    rt.add_argument("--kube-api", help="kubernetes discovery: API URL without credentials, e.g. "
                    "`kubectl proxy`'s http://127.0.0.1:8001 (default: in-cluster config)")
    rt.add_argument("--no-prompt-lookup", action="store_true",
                    help="do not offer prompt lookup (drafts from the request's own context)")
    rt.add_argument("--tokenizer", required=True,
                    help="the target's tokenizer: its checkpoint directory or Hugging Face name")
    rt.add_argument("--drafter", action="append", default=[], help="NAME=HOST:PORT (repeatable)")
    rt.add_argument("--default-drafter", default=PROMPT_LOOKUP,
                    help="drafter of requests in mode auto ('none' = no speculation)")
    rt.add_argument("--default-k", type=positive(int), default=4)
    rt.add_argument("--max-batch", type=positive(int), default=32)
    rt.add_argument("--max-queue", type=positive(int), default=256)
    rt.add_argument("--draft-timeout", type=positive(float), default=5.0)
    rt.add_argument("--micro-batches", type=positive(int), default=1,
                    help="micro-batches in flight (2: draft one while verifying the other)")
    rt.add_argument("--redis-url", default=os.environ.get("SPIN_REDIS_URL"),
                    help="acceptance statistics (default: $SPIN_REDIS_URL, else in process); "
                    "$SPIN_REDIS_PASSWORD supplies a password the URL lacks")
    rt.add_argument("--stats-spill", metavar="PATH",
                    help="where statistics that could not be written to Redis at shutdown are "
                    "kept, to be written at the next start (one file per router replica; "
                    "default: none, their loss counted in spin:stats_steps_lost_total)")
    rt.add_argument("--verifier-outage", type=positive(float), default=30.0, metavar="SECONDS",
                    help="how long running requests wait for an unreachable verifier (e.g. one "
                    "restarting) before they fail with UNAVAILABLE")
    rt.add_argument("--http-port", type=int,
                    help="the OpenAI-compatible HTTP API's port (0 = a free one; default 8000, "
                    "or a free one with --port 0)")
    rt.add_argument("--no-http", action="store_true", help="serve no HTTP API")
    rt.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                    help="clients must send it as 'Authorization: Bearer KEY' (HTTP) or the same "
                    "'authorization' metadata (gRPC); health and reflection stay open "
                    "(default: $SPIN_API_KEY, else no key)")
    rt.add_argument("--chat-template", metavar="FILE",
                    help="a Jinja chat template for /v1/chat/completions (default: the "
                    "tokenizer's)")
    rt.add_argument("--served-model-name", help="the HTTP API's model id (default: the target's "
                    "name)")
    rt.add_argument("--policy", choices=("learned", "fixed"), default="learned",
                    help="learned: per-request drafter bandit + goodput-chosen k; fixed: "
                    "--default-drafter and --default-k for every request")
    rt.add_argument("--cost-model", help="cost model file from `spin profile` (learned policy)")
    rt.add_argument("--policy-config", help="JSON object overriding learned-policy settings, e.g. "
                    "'{\"score_rounds\": 2, \"selector\": {\"ucb_c\": 0.1}}'")
    rt.set_defaults(func=_router)


def _router(args: argparse.Namespace) -> int:
    service_logging()
    place(args)
    try:
        cfg = router_config(args)
        server = server_config(args)
    except ValueError as e:
        return fail("router", e)
    from ..router.server import run

    run(cfg, server)
    return 0


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of ``spin router``'s flags; ValueError saying which is wrong."""
    drafters = {}
    for spec in args.drafter:
        name, sep, addr = spec.partition("=")
        if not sep or not name or not addr:
            raise ValueError(f"--drafter wants NAME=HOST:PORT, got {spec!r}")
        drafters[name] = addr
    default = default_drafter(args.default_drafter)
    kube = None
    if args.discovery == "kubernetes":
        if not args.label_selector:
            raise ValueError("--discovery kubernetes needs --label-selector")
        kube = KubernetesDiscoveryConfig(args.label_selector, args.namespace, args.kube_api)
    elif not args.verifier:
        raise ValueError("--verifier HOST:PORT is required (or --discovery kubernetes)")
    elif default is not None and default != PROMPT_LOOKUP and default not in drafters:
        raise ValueError(f"--default-drafter {default!r} is not one of the drafters "
                         f"{sorted(drafters) + [PROMPT_LOOKUP]}")
    try:
        overrides = policy_overrides(args.policy_config)
    except ValueError as e:
        raise ValueError(f"--policy-config: {e}") from None
    if args.chat_template and not Path(args.chat_template).is_file():
        raise ValueError(f"--chat-template {args.chat_template}: no such file")
    return RouterConfig(args.verifier, str(args.tokenizer), drafters, default, args.default_k,
                        _redis_url(args.redis_url), args.policy, args.cost_model, kubernetes=kube,
                        policy_config=overrides, stats_spill=args.stats_spill,
                        http_port=None if args.no_http else _http_port(args),
                        api_key=args.api_key or None, chat_template=args.chat_template,
                        served_model_name=args.served_model_name,
                        scheduler=SchedulerConfig(max_batch=args.max_batch,
                                                  max_queue=args.max_queue,
                                                  draft_timeout_s=args.draft_timeout,
                                                  verifier_outage_s=args.verifier_outage,
                                                  micro_batches=args.micro_batches,
                                                  prompt_lookup=not args.no_prompt_lookup))


_FLAGGED = {
    RouterConfig: {"verifier", "tokenizer", "drafters", "default_drafter", "default_k",
                   "redis_url", "policy", "cost_model", "policy_config", "kubernetes",
                   "scheduler", "stats_spill", "http_port", "chat_template",
                   "served_model_name"},
    SchedulerConfig: {"max_batch", "max_queue", "draft_timeout_s", "micro_batches",
                      "prompt_lookup", "verifier_outage_s"},
    KubernetesDiscoveryConfig: {"label_selector", "namespace", "api_url"},
}
"""Per config class, the fields ``spin router`` has flags for (the others keep their defaults)."""


def unflagged(cfg: RouterConfig) -> list[str]:
    """The fields of ``cfg`` (nested ones dotted) that differ from their defaults but have no
    flag: what ``router_argv`` cannot pass on."""
    parts = [("", cfg, RouterConfig()), ("scheduler.", cfg.scheduler, SchedulerConfig())]
    if cfg.kubernetes is not None:
        parts.append(("kubernetes.", cfg.kubernetes,
                      KubernetesDiscoveryConfig(cfg.kubernetes.label_selector)))
    return [prefix + f.name for prefix, obj, default in parts for f in fields(obj)
            if f.name not in _FLAGGED[type(obj)]
            and getattr(obj, f.name) != getattr(default, f.name)]


def router_argv(cfg: RouterConfig) -> list[str]:
    """``cfg`` as ``spin router``'s flags (without the service flags: ``flags.server_argv``), the
    exact inverse of ``router_config``: it parses back to an equal config. ValueError for a field
    that has no flag and differs from its default (``unflagged``). As for ``spin router``, a
    ``redis_url`` of None leaves the child $SPIN_REDIS_URL, and $SPIN_REDIS_PASSWORD fills in a
    password the URL lacks."""
    missing = unflagged(cfg)
    if missing:
        raise ValueError(f"spin router has no flags for {missing}: they must keep their defaults")
    s = cfg.scheduler
    argv = ["--tokenizer", cfg.tokenizer]
    if cfg.verifier is not None:
        argv += ["--verifier", cfg.verifier]
    if cfg.kubernetes is not None:
        kube = cfg.kubernetes
        argv += ["--discovery", "kubernetes", "--label-selector", kube.label_selector]
        if kube.namespace is not None:
            argv += ["--namespace", kube.namespace]
        if kube.api_url is not None:
            argv += ["--kube-api", kube.api_url]
    for name, addr in cfg.drafters.items():
        argv += ["--drafter", f"{name}={addr}"]
    argv += ["--default-drafter", cfg.default_drafter or "none", "--default-k", str(cfg.default_k),
             "--max-batch", str(s.max_batch), "--max-queue", str(s.max_queue),
             "--draft-timeout", repr(s.draft_timeout_s), "--micro-batches", str(s.micro_batches),
             "--verifier-outage", repr(s.verifier_outage_s), "--policy", cfg.policy]
    if not s.prompt_lookup:
        argv.append("--no-prompt-lookup")
    if cfg.redis_url is not None:
        argv += ["--redis-url", cfg.redis_url]
    if cfg.cost_model is not None:
        argv += ["--cost-model", str(cfg.cost_model)]
    if cfg.stats_spill is not None:
        argv += ["--stats-spill", cfg.stats_spill]
    argv += ["--no-http"] if cfg.http_port is None else ["--http-port", str(cfg.http_port)]
    if cfg.chat_template is not None:
        argv += ["--chat-template", cfg.chat_template]
    if cfg.served_model_name is not None:
        argv += ["--served-model-name", cfg.served_model_name]
    if cfg.policy_config:
        argv += ["--policy-config", json.dumps(cfg.policy_config)]
    return argv


def _http_port(args: argparse.Namespace) -> int:
    if args.http_port is not None:
        return args.http_port
    return 0 if getattr(args, "port", None) == 0 else 8000


def _redis_url(url: str | None) -> str | None:
    """The statistics store URL, with $SPIN_REDIS_PASSWORD (a Kubernetes Secret) filled in."""
    from urllib.parse import quote, urlsplit, urlunsplit

    password = os.environ.get("SPIN_REDIS_PASSWORD")
    if not url or not password:
        return url
    parts = urlsplit(url)
    if parts.password:
        return url
    netloc = f"{quote(parts.username or '', safe='')}:{quote(password, safe='')}@{parts.netloc}"
    return urlunsplit(parts._replace(netloc=netloc))
