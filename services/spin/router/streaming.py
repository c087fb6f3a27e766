"""A request's client stream, as plain events: the tokens each step accepted, their text, and at
the end the finish reason, usage and speculation statistics; or an error that ends it.

The scheduler hands ``Streamer.emit`` the tokens a verification step produced; it cuts them at
``max_tokens`` or the end-of-sequence token, turns them into text (``requests.TextStream``:
incremental, stop strings held back until they cannot match) and puts one ``Chunk`` on the
request's ``out`` queue. ``server.py`` turns each event into a ``spin.v1.GenerateResponse`` (a
``RequestError`` into the call's status); nothing here knows the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from ..engine.logprobs import TokenLogprobs
from ..engine.prediction import PREDICTION
from ..obs import metrics
from .accounting import StepInfo
from .requests import RouterRequest, TextStream

FinishReason = Literal["length", "stop"]
ErrorCode = Literal["invalid_argument", "resource_exhausted", "unavailable", "internal"]
"""Why a request failed; ``server.py`` maps each to its gRPC status."""


@dataclass(frozen=True)
class RequestError:
    """Ends a client stream with an error."""

    code: ErrorCode
    message: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    accepted_prediction_tokens: int = 0
    """Predicted Outputs: draft tokens of the ``prediction`` drafter the target accepted."""
    rejected_prediction_tokens: int = 0
    """And those it rejected (0 without a prediction)."""


@dataclass(frozen=True)
class DrafterUsage:
    """One drafter's part in a request."""

    drafter: str
    steps: int
    draft_tokens: int
    accepted_tokens: int


@dataclass(frozen=True)
class SpeculationStats:
    """A request's speculation, over all its steps."""

    steps: int
    steps_without_speculation: int
    draft_tokens: int
    accepted_tokens: int
    tau: float
    """Tokens per verification step."""
    drafters: tuple[DrafterUsage, ...]
    """By drafter name."""


@dataclass(frozen=True)
class Chunk:
    """One message of a request's stream: what one verification step produced."""

    request_id: str
    token_ids: list[int]
    """Newly accepted tokens (cut at ``max_tokens`` or the end-of-sequence token)."""
    text: str
    """Their text: what can be sent now (stop strings and incomplete characters held back)."""
    step: StepInfo
    finish: FinishReason | None = None
    """Set on the last message only, with ``usage`` and ``speculation``."""
    usage: Usage | None = None
    speculation: SpeculationStats | None = None
    logprobs: list[TokenLogprobs] | None = None
    """One per ``token_ids`` when the request asked for them."""


StreamEvent = Chunk | RequestError
"""What a request's ``out`` queue carries."""


class Streamer:
    """The client streams of the running requests."""

    def __init__(self, decode: Callable[[list[int]], str], eos_id: int | None,
                 jump_forward: bool = True) -> None:
        self.decode = decode
        self.eos_id = eos_id
        self.jump_forward = jump_forward
        """Structured output: after a step's tokens, append every next token that is the only
        one the request's grammar allows (constrained decoding could emit nothing else, greedy
        or sampled), unverified: the verifier takes them in as context with the next step. Not
        for a request that asked for log-probabilities (these tokens have none)."""
        self._text: dict[str, TextStream] = {}

    def open(self, r: RouterRequest) -> None:
        self._text[r.request_id] = TextStream(self.decode, r.params.stop)

    def close(self, r: RouterRequest) -> None:
        self._text.pop(r.request_id, None)

    def fail(self, r: RouterRequest, code: ErrorCode, message: str) -> None:
        r.out.put_nowait(RequestError(code, message))

    def _take(self, r: RouterRequest, tok: int) -> FinishReason | None:
        """Append one emitted token; why the request is done with it (None: not done)."""
        grammar = r.constraint
        if grammar is not None and grammar.advance([tok]) != 1:
            return "stop"  # complete (the end-of-sequence token is all that may follow)
        r.generated.append(tok)
        if len(r.generated) >= r.params.max_tokens:
            return "length"
        if tok == self.eos_id and not r.params.ignore_eos:
            return "stop"
        return "stop" if grammar is not None and grammar.done else None

    def emit(self, r: RouterRequest, tokens: list[int], step: StepInfo,
             logprobs: list[TokenLogprobs] | None = None) -> Chunk:
        """Append a step's ``tokens`` (and their ``logprobs``, if asked) to ``r`` and send them;
        the chunk sent (``finish`` set when the request is done: the caller finishes it)."""
        start = len(r.generated)
        finish: FinishReason | None = None
        for tok in tokens:
            if (finish := self._take(r, tok)) is not None:
                break
        grammar = r.constraint
        if grammar is not None and self.jump_forward and logprobs is None:
            jumped = len(r.generated)
            while finish is None and (tok := grammar.only()) is not None:
                finish = self._take(r, tok)  # the one token the grammar allows: no draw
            metrics.GRAMMAR_FORCED_TOKENS.inc(len(r.generated) - jumped)
        text, hit = self._text[r.request_id].push(r.generated, final=finish is not None)
        if hit:
            finish = "stop"
        done = finish is not None
        emitted = r.generated[start:]
        chunk = Chunk(r.request_id, emitted, text, step, finish,
                      _usage(r) if done else None,
                      _speculation(r) if done else None,
                      logprobs[:len(emitted)] if logprobs is not None else None)
        r.out.put_nowait(chunk)
        return chunk


def _usage(r: RouterRequest) -> Usage:
    """``r``'s token counts, and what its prediction's drafts got accepted and rejected."""
    pred = r.tally.drafters.get(PREDICTION)
    accepted = pred.accepted_tokens if pred is not None else 0
    rejected = pred.draft_tokens - accepted if pred is not None else 0
    return Usage(len(r.prompt), len(r.generated), accepted, rejected)


def _speculation(r: RouterRequest) -> SpeculationStats:
    t = r.tally
    return SpeculationStats(
        t.steps, t.steps_off, t.draft_tokens, t.accepted_tokens,
        len(r.generated) / t.steps if t.steps else 0.0,
        tuple(DrafterUsage(name, d.steps, d.draft_tokens, d.accepted_tokens)
              for name, d in sorted(t.drafters.items())))
