"""What a valid ``spin.v1.GenerateRequest`` is: the router's checks of a client's request.

``request_from_proto`` turns a request into the scheduler's ``RouterRequest`` or raises
ValueError naming the field and its allowed range (the router answers INVALID_ARGUMENT with that
message). Nothing else escapes it, whatever the message holds: enum values outside their enum,
NaN or infinite floats, oversized strings and lists are all refused before any work is done on
them. The limits below are documented on the fields in ``proto/spin/v1/generation.proto``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Collection

from google.protobuf.message import Message

from ..engine.logprobs import MAX_LOGPROBS
from ..engine.sampling import SamplingParams
from ..rpc.convert import sampling_from_proto
from ..v1 import generation_pb2
from .requests import RouterRequest

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
PROMPT_CHARS_PER_TOKEN = 64
"""A ``prompt`` longer than this many characters per token of the target's context cannot fit
whatever it tokenizes to, and is refused before it is tokenized."""

MODES = {generation_pb2.SPECULATION_MODE_UNSPECIFIED: "auto",
         generation_pb2.SPECULATION_MODE_AUTO: "auto",
         generation_pb2.SPECULATION_MODE_OFF: "off",
         generation_pb2.SPECULATION_MODE_DRAFTER: "drafter"}
"""``SpeculationMode`` -> the scheduler's mode."""

Tokenize = Callable[[str], list[int]]
"""Prompt text -> token ids of the target's tokenizer."""


def check_enums(msg: Message, prefix: str = "") -> None:
    """ValueError for the first enum field of ``msg`` (nested messages included) holding a value
    its enum does not define (proto3 enums are open: a client may send any int32)."""
    for field, value in msg.ListFields():
        name = f"{prefix}{field.name}"
        if field.enum_type is not None:
            allowed = field.enum_type.values_by_number
            for v in (value if field.is_repeated else [value]):
                if v not in allowed:
                    choices = ", ".join(f"{n} ({e.name})" for n, e in sorted(allowed.items()))
                    raise ValueError(f"{name} {v} is not a {field.enum_type.name}; allowed: "
                                     f"{choices}")
        elif field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for i, sub in enumerate(value if field.is_repeated else [value]):
                check_enums(sub, f"{name}[{i}]." if field.is_repeated else f"{name}.")


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


def prompt_ids(req: generation_pb2.GenerateRequest, tokenize: Tokenize, max_context: int,
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


def request_from_proto(req: generation_pb2.GenerateRequest, tokenize: Tokenize, max_context: int,
                       vocab_size: int, drafter_names: Callable[[], Collection[str]],
                       max_k: int = MAX_K) -> RouterRequest:
    """The request as the scheduler takes it; ValueError names what is wrong (and nothing else
    is raised). ``drafter_names()`` is asked only for a request naming a drafter."""
    check_enums(req)
    check_request_id(req.request_id)
    if req.max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0, got {req.max_tokens}")
    check_stop(req.stop)
    spec = req.speculation
    check_text(spec.drafter, "speculation.drafter", MAX_DRAFTER_NAME_CHARS)
    if not 0 <= spec.k <= max_k:
        raise ValueError(f"speculation.k must be in [0, {max_k}] (0 = the policy's choice), "
                         f"got {spec.k}")
    sampling = sampling_from_proto(req.sampling) if req.HasField("sampling") else SamplingParams()
    ids = prompt_ids(req, tokenize, max_context, vocab_size)
    if len(ids) + req.max_tokens > max_context:
        raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds "
                         f"the context of {max_context} tokens")
    mode = MODES[spec.mode]
    if mode == "drafter" and spec.drafter not in (known := drafter_names()):
        raise ValueError(f"unknown drafter {spec.drafter!r} for speculation.drafter; known: "
                         f"{sorted(known)}")
    logprobs = req.logprobs if req.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
    return RouterRequest(req.request_id or uuid.uuid4().hex, ids, req.max_tokens, sampling,
                         tuple(req.stop), req.ignore_eos, mode,
                         spec.drafter if mode == "drafter" else None, spec.k,
                         early_stop=spec.early_stop, logprobs=logprobs)
