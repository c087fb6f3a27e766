"""What the router connects to and how it decides: its configuration, in one place.

``RouterConfig`` is what ``spin router`` runs with (``cli/services.py`` builds it from flags, or
reads it whole from a JSON file: ``spin router --config FILE``, which ``spin serve`` writes with
``to_json``); ``SchedulerConfig`` its batching and failure handling. ``from_json`` checks the
file's keys and value types against the dataclasses, so a new field travels with no list of
flags to extend.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from ..policy.base import PROMPT_LOOKUP
from .discovery import KubernetesDiscoveryConfig


@dataclass
class SchedulerConfig:
    """Batching and failure handling of the router."""

    max_batch: int = 32
    """Requests decoding at once (capped by the verifier's cache slots)."""
    max_queue: int = 256
    """Requests waiting beyond the batch; more are refused with RESOURCE_EXHAUSTED."""
    draft_timeout_s: float = 5.0
    """A drafter slower than this is treated as down for the step."""
    verify_timeout_s: float = 120.0
    """A verification call slower than this fails the stream (then retried)."""
    verifier_outage_s: float = 30.0
    """Running requests fail with UNAVAILABLE when the verifier stays unreachable this long
    (until then they wait, and a verifier that is back gets their whole contexts)."""
    micro_batches: int = 1
    """Micro-batches in flight: with 2, one is drafted while the other is verified (SPIN's
    pipeline); 1 = draft, then verify, the whole batch."""
    plain_steps: int = 4
    """Plain decoding steps one verification call runs for a micro-batch whose requests all have
    speculation off, or that the policy runs plain until it decides again (the loss guard's
    plain steps: ``StepPlan.hold``), with no grammar, while no request waits for admission: one
    round trip to the verifier and one router step per this many tokens (as vLLM's multi-step
    scheduling). Tokens then reach the client this many at a time; 1: one call per token."""
    step_trace: str | None = None
    """A file every verified step is appended to, one JSON object a line: what each request
    drafted and accepted, the step's measured times and the cost model's prediction of them
    (``step_trace.py``); None: no trace."""
    prompt_lookup: bool = True
    """Offer prompt lookup (model-free drafts from the request's own context, computed here in the
    router) to the policy."""
    suffix_decoding: bool = True
    """Offer suffix decoding (model-free drafts from earlier requests' prompts and outputs, and
    the request's own, computed here in the router over one store that all its requests share:
    ``engine/suffix_decoding.py``) to the policy."""
    suffix_store_tokens: int = 65536
    """Tokens suffix decoding's store keeps (about 0.75 KB of the router's memory each); past
    them the least recently used requests' texts are evicted."""
    suffix_share: bool = False
    """Share suffix decoding's texts (with it on) with the other routers on ``redis_url`` (which
    it needs):
    each finished request's prompt and output go to a Redis stream that every router on that
    Redis reads into its store, and a router that starts reads the latest first
    (``stats/suffix_share.py``). Off by default: the stream holds users' texts."""
    suffix_share_entries: int = 4096
    """Texts (requests) the shared stream keeps, the newest (approximately: Redis trims whole
    nodes)."""
    grammar_drafts: bool = True
    """Use the grammar's forced tokens (structured-output requests only): where the grammar
    allows one continuation, offer it as a draft to the policy (``router/structured.py``);
    where it allows one token, append it without verification (``Streamer.jump_forward``)."""
    predicted_outputs: bool = True
    """Offer Predicted Outputs (model-free drafts from a request's own ``prediction``:
    ``engine/prediction.py``) to the policy; it drafts only for requests that carry one."""


@dataclass
class RouterConfig:
    """What the router connects to and how it decides."""

    verifier: str | None = None
    """Verifier address (host:port); None with Kubernetes discovery (and in a ``ServeConfig``,
    which fills it in)."""
    tokenizer: str = ""
    """The target's tokenizer: its checkpoint directory or Hugging Face name ('' in a
    ``ServeConfig``: its target's)."""
    drafters: dict[str, str] = field(default_factory=dict)
    """Drafter name -> address (static discovery)."""
    default_drafter: str | None = PROMPT_LOOKUP
    """The fixed policy's drafter for requests in mode auto (None: no speculation)."""
    default_k: int = 4
    """The fixed policy's k."""
    redis_url: str | None = None
    """Acceptance statistics store; None = in process."""
    policy: Literal["fixed", "learned"] = "learned"
    """'learned': per-request bandit over drafters + goodput-chosen k; 'fixed': default_drafter
    and default_k for every request."""
    cost_model: str | None = None
    """The fitted cost model (``spin profile``) for the learned policy; None or missing = its
    batch-size -> k table."""
    rpc_overhead_s: float = 0.0015
    """Round-trip time the router adds to each drafter and verifier call (the profile measures
    compute in process); added to the cost model's fixed terms."""
    policy_config: dict = field(default_factory=dict)
    """Overrides of the learned policy's settings (``policy.learned_config.learned_config``), e.g.
    ``{"score_rounds": 2, "selector": {"ucb_c": 0.1}}``."""
    kubernetes: KubernetesDiscoveryConfig | None = None
    """Find drafter and verifier replicas through the Kubernetes API (instead of the static
    addresses above)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Batching and failure handling."""
    stats_spill: str | None = None
    """A file for the statistics that could not be written to Redis at shutdown, written there
    at the next start (``stats/redis_store.py``); one per router replica. None: such a loss is
    counted (``spin:stats_steps_lost_total``) and logged."""
    http_port: int | None = 8000
    """The OpenAI-compatible HTTP API's port (``openai_api/``; 0: a free one); None: no HTTP
    API."""
    api_key: str | None = None
    """Clients must send ``Authorization: Bearer <api_key>`` (HTTP) or the same
    ``authorization`` metadata (gRPC); None: no key. A secret: ``spin router`` reads it from
    ``--api-key`` or $SPIN_API_KEY, and ``spin serve`` passes it in the environment."""
    chat_template: str | None = None
    """A Jinja chat template file for ``/v1/chat/completions`` instead of the tokenizer's."""
    served_model_name: str | None = None
    """The model id of the HTTP API (``/v1/models``); None: the target's name."""


def unknown_default_drafter(cfg: RouterConfig, in_verifier: tuple[str, ...] | list[str] = ()
                            ) -> str | None:
    """Why ``cfg.default_drafter`` names no drafter the router has (None: it does): one of
    ``cfg.drafters``, a model-free drafter, or one of ``in_verifier`` (the verifier's draft
    heads and colocated drafters, known once it answers). Discovery finds drafters later."""
    from ..engine.model_free import MODEL_FREE

    default = cfg.default_drafter
    if cfg.kubernetes is not None or default in (None, *MODEL_FREE, *cfg.drafters, *in_verifier):
        return None
    inside = f"; inside the verifier: {sorted(in_verifier)}" if in_verifier else ""
    return (f"--default-drafter {default!r} is not one of the drafters "
            f"{sorted(cfg.drafters) + sorted(MODEL_FREE)}{inside}")


def to_json(cfg: RouterConfig) -> str:
    """``cfg`` as JSON (``from_json`` reads it back to an equal config). ``api_key`` is left
    out: a secret goes in the environment ($SPIN_API_KEY), never in a file."""
    return json.dumps(dataclasses.asdict(dataclasses.replace(cfg, api_key=None)), indent=2)


def from_json(text: str) -> RouterConfig:
    """The ``RouterConfig`` a JSON object describes (missing keys keep their defaults);
    ValueError naming the key for an unknown key or a value of the wrong type."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    return _build(RouterConfig, doc, "")


def _build(cls: type, doc: object, where: str) -> Any:
    """An instance of the dataclass ``cls`` from a JSON object (``where``: its dotted path)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where or 'the config'} must be a JSON object, got {doc!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(doc) - names)
    if unknown:
        raise ValueError(f"unknown key {prefix}{unknown[0]} (known: {sorted(names)})")
    required = [f.name for f in dataclasses.fields(cls) if f.name not in doc
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ValueError(f"{prefix}{required[0]} is required")
    return cls(**{k: _value(hints[k], v, f"{prefix}{k}") for k, v in doc.items()})


def _value(hint: Any, value: object, where: str) -> Any:
    """``value`` as the type ``hint`` (dataclasses built, unions tried in turn); ValueError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in args:
            try:
                return _value(arg, value, where)
            except ValueError as e:
                errors.append(e)
        if value is not None and dataclasses.is_dataclass(args[0]):
            raise errors[0]  # what is wrong inside the object
    elif origin is Literal:
        if value in args:
            return value
        raise ValueError(f"{where} must be one of {list(args)}, got {value!r}")
    elif origin is dict:
        if isinstance(value, dict) and all(isinstance(k, str) for k in value):
            return {k: _value(args[1], v, f"{where}.{k}") for k, v in value.items()} if args \
                else value
    elif dataclasses.is_dataclass(hint):
        return _build(hint, value, where)
    elif hint is type(None):
        if value is None:
            return None
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, hint):
        return value
    raise ValueError(f"{where} must be {_name(hint)}, got {value!r}")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")
