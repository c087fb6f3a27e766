"""``spin verifier``, ``spin drafter`` and ``spin router``: the gRPC services, one process each.

``router_config`` builds the router's ``RouterConfig`` from its flags, or reads it whole from
``--config FILE`` (JSON, ``router/config.py``; ``spin serve`` starts its router child so); either
way ``check_router_config`` checks it.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..engine.verifier import HEAD_WINDOW
from ..router.config import RouterConfig, SchedulerConfig, from_json
from ..router.discovery import KubernetesDiscoveryConfig
from .flags import (check_policy_overrides, fail, model_flags, named_models, place, positive,
                    quantize_flag, runner_config, server_config, service_flags, service_logging,
                    threads)

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
    sp.add_argument("--head", action="append", default=[], metavar="NAME=PATH",
                    help="serve an EAGLE-3 draft head (its checkpoint directory) inside the "
                         "verifier as drafter NAME; repeatable")
    sp.add_argument("--head-window", type=positive(int), default=HEAD_WINDOW,
                    metavar="POSITIONS",
                    help="per request, how many committed positions' target states are kept "
                         "for the heads (a request that starts using a head later attends to "
                         f"that many positions of its context; default {HEAD_WINDOW})")
    sp.add_argument("--colocate", action="append", default=[], metavar="NAME=PATH",
                    help="serve a draft model (its checkpoint directory, the target's "
                         "vocabulary) inside the verifier as drafter NAME: it drafts right "
                         "after each verdict, with no call of its own; repeatable")
    sp.add_argument("--colocate-quantize", choices=("auto", "none", "int8"), default="none",
                    help="the colocated drafters' weights (auto: int8 on the CPU in float32)")
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
    from ..engine.colocated import Colocated
    from ..engine.memory import resolve_device
    from ..engine.quant import resolve
    from ..verifier.server import run

    service_logging()
    threads(args)
    try:
        runner = runner_config(args)
        colocated = Colocated(named_models(args.colocate, "--colocate"),
                              resolve(args.colocate_quantize, resolve_device(runner.device),
                                      runner.dtype)
                              if args.colocate else "none")
        run(str(args.model), server_config(args), runner,
            decompose=not args.no_decompose, step_times=args.step_times,
            heads=named_models(args.head, "--head"),
            head_window=args.head_window, colocated=colocated)
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
    rt.add_argument("--config", metavar="FILE",
                    help="the router's whole configuration as JSON (a RouterConfig, as spin serve "
                    "writes it to build/serve/router.json); the router flags below are then left "
                    "out, except --api-key")
    rt.add_argument("--api-key", default=os.environ.get("SPIN_API_KEY"),
                    help="clients must send it as 'Authorization: Bearer KEY' (HTTP) or the same "
                    "'authorization' metadata (gRPC); health and reflection stay open "
                    "(default: $SPIN_API_KEY, else no key)")
    g = rt.add_argument_group("router settings (without --config)")
    g.add_argument("--verifier", help="verifier address host:port (static discovery)")
    g.add_argument("--discovery", choices=("static", "kubernetes"), default="static",
                   help="static: --verifier/--drafter addresses; kubernetes: watch EndpointSlices "
                   "of the drafter and verifier Services (labels spin.dev/role, spin.dev/drafter)")
    g.add_argument("--label-selector",
                   help="kubernetes discovery: EndpointSlices of this release, e.g. "
                   "app.kubernetes.io/instance=spin")
    g.add_argument("--namespace", help="kubernetes discovery: namespace (default: $POD_NAMESPACE)")
    g.add_argument("--kube-api", help="kubernetes discovery: API URL without credentials, e.g. "
                   "`kubectl proxy`'s http://127.0.0.1:8001 (default: in-cluster config)")
    g.add_argument("--no-prompt-lookup", action="store_true",
                   help="do not offer prompt lookup (drafts from the request's own context)")
    suffix_flags(g)
    g.add_argument("--tokenizer", help="the target's tokenizer: its checkpoint directory or "
                   "Hugging Face name (required without --config)")
    g.add_argument("--drafter", action="append", default=[], help="NAME=HOST:PORT (repeatable)")
    g.add_argument("--default-drafter", default=PROMPT_LOOKUP,
                   help="drafter of requests in mode auto ('none' = no speculation)")
    g.add_argument("--default-k", type=positive(int), default=4)
    g.add_argument("--max-batch", type=positive(int), default=32)
    g.add_argument("--max-queue", type=positive(int), default=256)
    g.add_argument("--draft-timeout", type=positive(float), default=5.0)
    g.add_argument("--micro-batches", type=positive(int), default=1,
                   help="micro-batches in flight (2: draft one while verifying the other)")
    g.add_argument("--plain-steps", type=positive(int), default=4,
                   help="plain decoding steps per verifier call for a micro-batch whose "
                   "requests all have speculation off (1: a call per token)")
    g.add_argument("--redis-url", default=os.environ.get("SPIN_REDIS_URL"),
                   help="acceptance statistics (default: $SPIN_REDIS_URL, else in process); "
                   "$SPIN_REDIS_PASSWORD supplies a password the URL lacks")
    g.add_argument("--step-trace", metavar="FILE",
                   help="append every verified step to FILE as a JSON line: each request's "
                   "drafter, k and accepted tokens, the step's times and their prediction")
    g.add_argument("--stats-spill", metavar="PATH",
                   help="where statistics that could not be written to Redis at shutdown are "
                   "kept, to be written at the next start (one file per router replica; "
                   "default: none, their loss counted in spin:stats_steps_lost_total)")
    g.add_argument("--verifier-outage", type=positive(float), default=30.0, metavar="SECONDS",
                   help="how long running requests wait for an unreachable verifier (e.g. one "
                   "restarting) before they fail with UNAVAILABLE")
    g.add_argument("--http-port", type=int,
                   help="the OpenAI-compatible HTTP API's port (0 = a free one; default 8000, "
                   "or a free one with --port 0)")
    g.add_argument("--no-http", action="store_true", help="serve no HTTP API")
    g.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the "
                   "tokenizer's)")
    g.add_argument("--served-model-name", help="the HTTP API's model id (default: the target's "
                   "name)")
    g.add_argument("--policy", choices=("learned", "fixed"), default="learned",
                   help="learned: per-request drafter bandit + goodput-chosen k; fixed: "
                   "--default-drafter and --default-k for every request")
    g.add_argument("--cost-model", help="cost model file from `spin profile` (learned policy)")
    g.add_argument("--policy-config", help="JSON object overriding learned-policy settings, e.g. "
                   "'{\"score_rounds\": 2, \"selector\": {\"ucb_c\": 0.1}}'")
    rt.set_defaults(func=_router, router_settings={
        a.dest: (a.option_strings[0], a.default) for a in g._group_actions})


def _router(args: argparse.Namespace) -> int:
    service_logging()
    place(args)
    try:
        cfg = router_config(args)
        server = server_config(args)
    except ValueError as e:
        return fail("router", e)
    from ..router_main import run

    run(cfg, server)
    return 0


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of ``spin router``'s flags, or of its ``--config`` file (then no
    router setting may be given as a flag too); ValueError saying what is wrong."""
    if args.config:
        given = [flag for dest, (flag, default) in args.router_settings.items()
                 if getattr(args, dest) != default]
        if given:
            raise ValueError(f"--config {args.config} holds the router's settings: leave out "
                             f"{', '.join(given)}")
        try:
            cfg = from_json(Path(args.config).read_text())
        except OSError as e:
            raise ValueError(f"--config {args.config}: {e.strerror or e}") from None
        except ValueError as e:
            raise ValueError(f"--config {args.config}: {e}") from None
        cfg = replace(cfg, api_key=cfg.api_key or args.api_key or None,
                      redis_url=_redis_url(cfg.redis_url or args.redis_url))
    else:
        cfg = _flags_config(args)
    check_router_config(cfg)
    return cfg


def _flags_config(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of the router settings' flags."""
    drafters = {}
    for spec in args.drafter:
        name, sep, addr = spec.partition("=")
        if not sep or not name or not addr:
            raise ValueError(f"--drafter wants NAME=HOST:PORT, got {spec!r}")
        drafters[name] = addr
    kube = None
    if args.discovery == "kubernetes":
        if not args.label_selector:
            raise ValueError("--discovery kubernetes needs --label-selector")
        kube = KubernetesDiscoveryConfig(args.label_selector, args.namespace, args.kube_api)
    if not args.tokenizer:
        raise ValueError("--tokenizer is required (or --config FILE)")
    try:
        overrides = json.loads(args.policy_config) if args.policy_config else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--policy-config: not JSON ({e}): {args.policy_config!r}") from None
    return RouterConfig(
        verifier=args.verifier, tokenizer=str(args.tokenizer), drafters=drafters,
        default_drafter=default_drafter(args.default_drafter), default_k=args.default_k,
        redis_url=_redis_url(args.redis_url), policy=args.policy, cost_model=args.cost_model,
        kubernetes=kube, policy_config=overrides, stats_spill=args.stats_spill,
        http_port=None if args.no_http else _http_port(args), api_key=args.api_key or None,
        chat_template=args.chat_template, served_model_name=args.served_model_name,
        scheduler=SchedulerConfig(max_batch=args.max_batch, max_queue=args.max_queue,
                                  draft_timeout_s=args.draft_timeout,
                                  verifier_outage_s=args.verifier_outage,
                                  micro_batches=args.micro_batches,
                                  plain_steps=args.plain_steps,
                                  step_trace=args.step_trace,
                                  prompt_lookup=not args.no_prompt_lookup,
                                  suffix_decoding=not args.no_suffix_decoding,
                                  suffix_store_tokens=args.suffix_store_tokens,
                                  suffix_share=args.suffix_share,
                                  suffix_share_entries=args.suffix_share_entries,
                                  grammar_drafts=not args.no_grammar_drafts,
                                  predicted_outputs=not args.no_predicted_outputs))


def suffix_flags(g: argparse._ActionsContainer) -> None:
    """``--no-suffix-decoding``, ``--suffix-store-tokens``, ``--suffix-share``,
    ``--suffix-share-entries``, ``--no-grammar-drafts`` and
    ``--no-predicted-outputs`` (``spin router``, ``spin serve``)."""
    g.add_argument("--no-suffix-decoding", action="store_true",
                   help="do not offer suffix decoding (drafts from earlier requests' prompts and "
                   "outputs, kept in a store the router's requests share)")
    g.add_argument("--suffix-store-tokens", type=positive(int), default=65536, metavar="N",
                   help="tokens suffix decoding's store keeps (about 0.75 KB each; least "
                   "recently used requests' texts are evicted past them)")
    g.add_argument("--suffix-share", action="store_true",
                   help="share suffix decoding's texts with the other routers on the same Redis "
                   "(each finished request's prompt and output, as token ids, in a Redis stream "
                   "they all read; needs Redis)")
    g.add_argument("--suffix-share-entries", type=positive(int), default=4096, metavar="N",
                   help="requests' texts the shared stream keeps (the newest)")
    g.add_argument("--no-grammar-drafts", action="store_true",
                   help="do not use what a structured-output request's grammar forces next "
                   "(keys, brackets, enum values): no grammar drafts, no jump-forward")
    g.add_argument("--no-predicted-outputs", action="store_true",
                   help="do not draft from a request's prediction (OpenAI's Predicted Outputs; "
                   "the prediction is then ignored)")


def check_router_config(cfg: RouterConfig) -> None:
    """ValueError, naming the flag, for a config the router cannot run with: no verifier and no
    discovery, bad learned-policy settings, no chat template file (a default drafter is checked
    once the verifier says which drafters it serves: ``config.unknown_default_drafter``)."""
    if cfg.kubernetes is None and not cfg.verifier:
        raise ValueError("--verifier HOST:PORT is required (or --discovery kubernetes)")
    if not cfg.tokenizer:
        raise ValueError("--tokenizer is required")
    if cfg.scheduler.suffix_share and not cfg.redis_url:
        raise ValueError("--suffix-share needs --redis-url (the routers share through Redis)")
    try:
        if not isinstance(cfg.policy_config, dict):
            raise ValueError(f"needs a JSON object, got {cfg.policy_config!r}")
        check_policy_overrides(cfg.policy_config)
    except ValueError as e:
        raise ValueError(f"--policy-config: {e}") from None
    if cfg.chat_template and not Path(cfg.chat_template).is_file():
        raise ValueError(f"--chat-template {cfg.chat_template}: no such file")


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
