"""A request as the router tracks it: what it asks (``RequestParams``), where it is
(``RequestStatus``), its tokens and stream, and its accounting (``RequestTally``); and its
incremental text (``TextStream``: stop strings held back until they cannot match)."""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..engine.prompt_lookup import PromptLookupIndex
from ..engine.sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine.grammar import Constraint, GrammarSpec
    from ..obs.tracing import RequestTrace


class RequestStatus(enum.Enum):
    """Where a request is (nano-vllm's ``SequenceStatus``)."""

    WAITING = enum.auto()
    """In the queue: not yet admitted, or preempted (the services keep its context)."""
    RUNNING = enum.auto()
    """In a lane: stepped with its micro-batch."""
    FINISHED = enum.auto()
    """Done (finished, failed or cancelled): its stream is closed, its caches released."""


@dataclass(frozen=True)
class RequestParams:
    """What a request asks: validated, never changed while it runs."""

    request_id: str
    prompt: tuple[int, ...]
    """Prompt token ids."""
    max_tokens: int
    """Tokens to generate at most."""
    sampling: SamplingParams
    """Temperature, top-p and seed (greedy at temperature 0)."""
    stop: tuple[str, ...] = ()
    """Stop strings (not returned)."""
    ignore_eos: bool = False
    """Go on past the end-of-sequence token."""
    mode: Literal["auto", "off", "drafter"] = "auto"
    """Speculation: the policy's choice, none, or the client's drafter."""
    drafter: str | None = None
    """Client-chosen drafter (mode 'drafter')."""
    k: int = 0
    """Client-chosen k (mode 'drafter'; 0 = the policy's)."""
    early_stop: bool = False
    """A client-chosen k's chain stops early as the policy's do (``Speculation.early_stop``)."""
    logprobs: int | None = None
    """Return the target's log-probabilities of the generated tokens and this many alternatives
    each (None: none)."""
    grammar: GrammarSpec | None = None
    """Structured output: the grammar the output follows (``engine/grammar.py``); None: free
    text."""
    prediction: tuple[int, ...] = ()
    """Predicted Outputs: the token ids of the text the output is expected to repeat in large
    part, drafted from by the ``prediction`` drafter (never changes the output); () = none."""


@dataclass
class DrafterTally:
    """One drafter's part in one request."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class RequestTally:
    """A request's accounting: its times and its steps (``accounting.py`` keeps it)."""

    arrival: float = field(default_factory=time.perf_counter)
    scheduled_at: float | None = None
    """First admitted (a preempted request keeps its first)."""
    first_token_at: float | None = None
    last_token_at: float | None = None
    steps: int = 0
    """Verification steps that produced tokens."""
    steps_off: int = 0
    """Of those, steps without speculation."""
    drafters: dict[str, DrafterTally] = field(default_factory=dict)
    """Drafter name -> its part."""
    preemptions: int = 0
    """Times the verifier dropped its cache for lack of blocks (it waited, then recomputed)."""

    @property
    def draft_tokens(self) -> int:
        return sum(t.draft_tokens for t in self.drafters.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(t.accepted_tokens for t in self.drafters.values())


@dataclass
class RouterRequest:
    """One admitted request: what it asks (``params``), its state, and its accounting
    (``tally``). What each service holds of its context is the services' own record
    (``pool.py``, ``proposers.py``), not the request's."""

    params: RequestParams
    status: RequestStatus = RequestStatus.WAITING
    cancelled: bool = False
    """The client went away: the request finishes at its lane's next tidy-up."""
    generated: list[int] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    """Sampling requests: the target's probability of each generated token under the processed
    row it was drawn from (0 = unknown); what a drafter's scoring call estimates its acceptance
    against. Empty when greedy."""
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Events for the client stream (``streaming.py``: a ``Chunk`` per step, or a
    ``RequestError`` that ends it)."""
    kv_pending: int = 0
    """KV blocks the admission counts for the request until its first verification."""
    cached: int = 0
    """Tokens of its prompt the verifier's prefix cache likely held at admission (the router's
    guess, ``prefix_affinity.py``): its prefill computes the rest."""
    lookup: PromptLookupIndex = field(default_factory=PromptLookupIndex)
    """Prompt lookup over the context, kept up to date by ``lookup_index``."""
    trace: RequestTrace | None = None
    """Spans of a sampled request (``obs/tracing.py``); None when not traced."""
    tally: RequestTally = field(default_factory=RequestTally)
    constraint: Constraint | None = None
    """Structured output: the matcher of the request's grammar (``engine/grammar.py``), which
    every step's draft and verification follow; None: free text."""

    @property
    def request_id(self) -> str:
        return self.params.request_id

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.params.prompt

    @property
    def sampling(self) -> SamplingParams:
        return self.params.sampling

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def traceparent(self) -> str:
        """W3C ``traceparent`` of the request's open step span for its tasks ('' if untraced)."""
        return self.trace.traceparent if self.trace is not None else ""

    @property
    def tracestate(self) -> str:
        return self.trace.tracestate if self.trace is not None else ""

    @property
    def context(self) -> list[int]:
        return list(self.prompt) + self.generated

    def context_from(self, start: int) -> list[int]:
        """``context[start:]`` without building the whole context (the per-step sync delta)."""
        p = len(self.prompt)
        return list(self.prompt[start:]) + self.generated[max(0, start - p):]

    def context_probs_from(self, start: int) -> list[float]:
        """The target's probability of each token of ``context_from(start)`` (0 for the prompt's
        and for any not known): one per token."""
        p = len(self.prompt)
        known = self.token_probs[max(0, start - p):]
        return ([0.0] * max(0, p - start) + known
                + [0.0] * (len(self.generated) - max(0, start - p) - len(known)))

    def lookup_index(self) -> PromptLookupIndex:
        """``lookup`` with every token of the context taken in (only the new ones are read)."""
        self.lookup.extend(self.context_from(len(self.lookup)))
        return self.lookup

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.generated)

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_tokens - len(self.generated)


class TextStream:
    """Incremental detokenization of a request's output, with stop strings held back until they
    cannot match: O(1) amortised per token, whatever the output's length.

    The standard incremental algorithm (vLLM's and TGI's prefix and read offsets): each push
    decodes only a window of recent tokens, ``tokens[prefix:]``, and takes the text after that
    of its start, ``tokens[prefix:read]`` (already taken), decoded the same way, so what a
    tokenizer does at the start of a sequence (a leading space dropped) or between tokens is
    the same on both sides. The window moves on (``prefix, read = read, len(tokens)``) once its
    text does not end in an incomplete UTF-8 sequence (a replacement character, as a byte-level
    BPE token ending inside a character gives); until then the complete text before it is
    taken, the rest waits for the next token. The text taken over all pushes is
    ``decode(tokens)``.

    Stop strings are searched only where a new match can be: the held-back tail (the last
    ``hold`` = longest stop string - 1 characters not sent) and the new text; the earliest match
    ends the stream there (nothing from it on is sent, then or later).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self.decode = decode
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        """Characters held back: a stop string could start in them."""
        self.prefix = 0
        """Start of the decoding window (tokens)."""
        self.read = 0
        """Tokens whose text has been taken; the window's first ``read - prefix`` give
        ``prefix_text``."""
        self.prefix_text = ""
        self.taken = 0
        """Characters of the window's text after ``prefix_text`` taken while it ended in an
        incomplete character."""
        self.held = ""
        """Text taken and not sent: the end of the text so far, where a stop string may begin."""
        self.stopped = False

    def push(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """(new text to send, stop string hit) for the request's tokens so far (``final``: no
        more will come; everything not cut by a stop string is sent). Only the tokens since the
        last push (and the window before them) are read."""
        if self.stopped:
            return "", True
        text = self.held + self._new_text(tokens, final)
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:  # the earliest stop string wins
            self.stopped, self.held = True, ""
            return text[:min(hits)], True
        cut = len(text) if final else max(0, len(text) - self.hold)
        self.held = text[cut:]
        return text[:cut], False

    def _new_text(self, tokens: list[int], final: bool) -> str:
        """The text ``tokens`` add to what was taken (decoding the window only)."""
        window = self.decode(tokens[self.prefix:])
        start = len(self.prefix_text) + self.taken
        if not final and window.endswith("\ufffd"):  # wait for the character's other bytes
            new = window.rstrip("\ufffd")[start:]
            self.taken += len(new)
            return new
        self.prefix, self.read = self.read, len(tokens)
        between = tokens[self.prefix:self.read]
        self.prefix_text = self.decode(between) if between else ""
        self.taken = 0
        return window[start:]
