"""What a valid request is: the router's checks of what a client asks, whichever API it came by.

Each adapter turns its own message into a plain ``ClientRequest`` (the gRPC one in ``server.py``
from a ``spin.v1.GenerateRequest``, the HTTP one in ``openai_api/`` from a pydantic body), and
``validate`` turns that into the scheduler's ``RouterRequest`` or raises ValueError naming the
field and its allowed range (the adapters answer INVALID_ARGUMENT or 400 with that message).
Nothing else escapes it, whatever the request holds: NaN or infinite floats, values beyond what
the services' messages carry, oversized strings and lists are all refused before any work is
done on them. The limits below are documented on the fields in
``proto/spin/v1/generation.proto``.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from ..engine.grammar import GrammarSpec
from ..engine.logprobs import MAX_LOGPROBS
from ..engine.model_free import GRAMMAR
from ..engine.prediction import PREDICTION
from ..engine.sampling import SamplingParams
from .requests import RequestParams, RouterRequest

MAX_REQUEST_ID_CHARS = 256
"""Longest client-chosen ``request_id``."""
MAX_STOP_STRINGS = 16
"""Most ``stop`` strings of one request."""
MAX_STOP_CHARS = 256
"""Longest ``stop`` string."""
MAX_DRAFTER_NAME_CHARS = 128
"""Longest ``speculation.drafter`` name."""
MAX_K = 16
"""Largest client-chosen ``speculation.k`` (the learned policy's own choices stop at 16 too,
``policy/goodput.py``'s ``k_max``); larger is refused, not capped."""
MAX_PREDICTION_CHARS = 262144
"""Longest ``prediction`` (Predicted Outputs' text); longer is refused, not cut."""
PROMPT_CHARS_PER_TOKEN = 64
"""A ``prompt`` longer than this many characters per token of the target's context cannot fit
whatever it tokenizes to, and is refused before it is tokenized."""
MODES = ("auto", "off", "drafter")
"""Speculation modes: the policy's choice, none, or the client's drafter."""
INT32_MAX = 2**31 - 1
"""``top_k`` travels to the verifier as an int32."""

Tokenize = Callable[[str], list[int]]
"""Prompt text -> token ids of the target's tokenizer."""


@dataclass(frozen=True)
class SpeculationRequest:
    """How a client asks its request to speculate."""

    mode: str = "auto"
    """One of ``MODES``: 'auto' (the router's policy picks the drafter and k every step), 'off'
    (the target alone) or 'drafter' (always ``drafter``)."""
    drafter: str = ""
    """The drafter of mode 'drafter' (ignored otherwise)."""
    k: int = 0
    """Draft tokens per step, 0..``MAX_K`` (0: the policy's choice)."""
    early_stop: bool = False
    """A client-chosen k's chain stops early where the policy's do (``k`` the longest)."""


@dataclass(frozen=True)
class ClientRequest:
    """What a client asks, as its API's adapter read it: plain values, not yet checked."""

    prompt: str = ""
    """Prompt text, tokenized by the router; or empty, with ``prompt_token_ids``."""
    prompt_token_ids: Sequence[int] = ()
    """The prompt as the target's token ids (not with ``prompt``)."""
    max_tokens: int = 0
    """Tokens to generate at most (> 0, and within the context with the prompt)."""
    temperature: float = 0.0
    """Sampling temperature: finite and >= 0 (0: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling's mass, in (0, 1] (1: off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: off)."""
    seed: int | None = None
    """The request's sampling seed (an int64); None: not reproducible."""
    stop: Sequence[str] = ()
    """Stop strings: the output ends before the first that appears."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token."""
    speculation: SpeculationRequest = field(default_factory=SpeculationRequest)
    """How the request speculates."""
    logprobs: int | None = None
    """Return each emitted token's log-probability and this many alternatives (None: no)."""
    prediction: str = ""
    """Predicted Outputs: text the output is expected to repeat in large part, tokenized by the
    router and drafted from (never changes the output); '' = none."""
    request_id: str = ""
    """The client's id for the request ('': the router assigns one)."""
    traceparent: str = ""
    """W3C trace context of the client's call, when its API carries it as a header (HTTP);
    '': the trace goes on from the current context (the gRPC server span)."""
    tracestate: str = ""
    """The ``tracestate`` that goes with ``traceparent``."""
    grammar: GrammarSpec | None = None
    """Structured output: the grammar every generated token follows (None: free text)."""


def check_text(value: str, field: str, limit: int) -> None:
    """ValueError when ``value`` is longer than ``limit`` characters."""
    if len(value) > limit:
        raise ValueError(f"{field} has {len(value)} characters; at most {limit} are allowed")


def check_stop(stop: Collection[str]) -> None:
    """ValueError unless ``stop`` holds at most ``MAX_STOP_STRINGS`` non-empty strings of at most
    ``MAX_STOP_CHARS`` characters."""
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed")
    for i, s in enumerate(stop):
        if not s:
            raise ValueError(f"stop[{i}] is empty: stop strings must not be empty")
        check_text(s, f"stop[{i}]", MAX_STOP_CHARS)


def check_request_id(request_id: str) -> None:
    """ValueError unless ``request_id`` is at most ``MAX_REQUEST_ID_CHARS`` printable characters
    (it goes into logs and traces as it is)."""
    check_text(request_id, "request_id", MAX_REQUEST_ID_CHARS)
    if not request_id.isprintable():
        raise ValueError("request_id must be printable (no control characters or line breaks)")


def check_speculation(spec: SpeculationRequest) -> None:
    """ValueError for an unknown mode, a too long drafter name or a k out of [0, ``MAX_K``]."""
    if spec.mode not in MODES:
        raise ValueError(f"speculation.mode {spec.mode!r} is not one of {list(MODES)}")
    check_text(spec.drafter, "speculation.drafter", MAX_DRAFTER_NAME_CHARS)
    if not 0 <= spec.k <= MAX_K:
        raise ValueError(f"speculation.k must be in [0, {MAX_K}] (0 = the policy's choice), "
                         f"got {spec.k}")


def sampling_params(req: ClientRequest) -> SamplingParams:
    """The request's sampling, each value checked (the field and its range named)."""
    if not (math.isfinite(req.temperature) and req.temperature >= 0):
        raise ValueError(f"sampling.temperature must be finite and >= 0 (0 = greedy), "
                         f"got {req.temperature}")
    if not 0 < req.top_p <= 1:  # NaN and inf fail too
        raise ValueError(f"sampling.top_p must be in (0, 1], got {req.top_p}")
    if not 0 <= req.top_k <= INT32_MAX:
        raise ValueError(f"sampling.top_k must be >= 0 (0 = off) and at most {INT32_MAX}, "
                         f"got {req.top_k}")
    if req.seed is not None and not -2**63 <= req.seed < 2**63:
        raise ValueError(f"sampling.seed must be a 64-bit integer, got {req.seed}")
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                          seed=req.seed)


def prompt_ids(req: ClientRequest, tokenize: Tokenize, max_context: int,
               vocab_size: int) -> tuple[int, ...]:
    """The prompt's token ids (``prompt`` tokenized, or ``prompt_token_ids``), checked to be
    non-empty, within the vocabulary and short enough to leave room for a token."""
    if req.prompt and len(req.prompt_token_ids):
        raise ValueError("set either prompt or prompt_token_ids, not both")
    if len(req.prompt_token_ids) >= max_context:
        raise ValueError(f"prompt_token_ids has {len(req.prompt_token_ids)} tokens; the context "
                         f"holds {max_context}")
    if len(req.prompt) > PROMPT_CHARS_PER_TOKEN * max_context:
        raise ValueError(f"prompt has {len(req.prompt)} characters; at most "
                         f"{PROMPT_CHARS_PER_TOKEN * max_context} ({PROMPT_CHARS_PER_TOKEN} per "
                         f"token of the {max_context}-token context) are allowed")
    if req.prompt:
        try:
            ids = tuple(int(t) for t in tokenize(req.prompt))
        except Exception as e:  # noqa: BLE001 - whatever the tokenizer makes of odd text
            raise ValueError(f"prompt cannot be tokenized: {e!r}") from None
    else:
        ids = tuple(req.prompt_token_ids)
    if not ids:
        raise ValueError("the prompt is empty")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prompt_token_ids must lie in [0, {vocab_size})")
    if len(ids) >= max_context:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {max_context}")
    return ids


def prediction_ids(text: str, tokenize: Tokenize, vocab_size: int) -> tuple[int, ...]:
    """The prediction's token ids (() for none), checked to be at most ``MAX_PREDICTION_CHARS``
    characters that tokenize within the vocabulary."""
    if not text:
        return ()
    check_text(text, "prediction", MAX_PREDICTION_CHARS)
    try:
        ids = tuple(int(t) for t in tokenize(text))
    except Exception as e:  # noqa: BLE001 - whatever the tokenizer makes of odd text
        raise ValueError(f"prediction cannot be tokenized: {e!r}") from None
    if any(not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"prediction tokenizes to ids outside the vocabulary [0, {vocab_size})")
    return ids


def validate(req: ClientRequest, tokenize: Tokenize, max_context: int, vocab_size: int,
             drafter_names: Callable[[], Collection[str]]) -> RouterRequest:
    """The request as the scheduler takes it; ValueError names what is wrong (and nothing else
    is raised). ``drafter_names()`` is asked only for a request naming a drafter."""
    check_request_id(req.request_id)
    if req.max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {req.max_tokens}")
    check_stop(req.stop)
    spec = req.speculation
    check_speculation(spec)
    sampling = sampling_params(req)
    ids = prompt_ids(req, tokenize, max_context, vocab_size)
    if len(ids) + req.max_tokens > max_context:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                         f"the context of {max_context} tokens")
    if spec.mode == "drafter" and spec.drafter not in (known := drafter_names()):
        raise ValueError(f"unknown drafter {spec.drafter!r} for speculation.drafter; known: "
                         f"{sorted(known)}")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}")
    if req.grammar is not None:
        req.grammar.check()
    elif spec.mode == "drafter" and spec.drafter == GRAMMAR:
        raise ValueError(f"speculation.drafter {GRAMMAR!r} drafts what the request's grammar "
                         "forces, and the request has none")
    prediction = prediction_ids(req.prediction, tokenize, vocab_size)
    if spec.mode == "drafter" and spec.drafter == PREDICTION and not prediction:
        raise ValueError(f"speculation.drafter {PREDICTION!r} drafts from the request's "
                         "prediction, and the request has none")
    return RouterRequest(RequestParams(
        request_id=req.request_id or uuid.uuid4().hex, prompt=ids, max_tokens=req.max_tokens,
        sampling=sampling, stop=tuple(req.stop), ignore_eos=req.ignore_eos, mode=spec.mode,
        drafter=spec.drafter if spec.mode == "drafter" else None, k=spec.k,
        early_stop=spec.early_stop, logprobs=req.logprobs, prediction=prediction,
        grammar=req.grammar))
