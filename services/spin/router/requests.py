"""A request as the router tracks it: tokens, what each service holds of its context, streaming
state (incremental text, stop strings) and speculation statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..engine.prompt_lookup import PromptLookupIndex
from ..engine.sampling import SamplingParams

if TYPE_CHECKING:
    from ..engine.translate import TranslatedContext
    from ..obs.tracing import RequestTrace


@dataclass
class DrafterTally:
    """One drafter's part in one request."""

    steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class RouterRequest:
    """One admitted request."""

    request_id: str
    prompt: tuple[int, ...]
    """Prompt token ids."""
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...] = ()
    """Stop strings (not returned)."""
    ignore_eos: bool = False
    mode: Literal["auto", "off", "drafter"] = "auto"
    drafter: str | None = None
    """Client-chosen drafter (mode 'drafter')."""
    k: int = 0
    """Client-chosen k (mode 'drafter'; 0 = policy's)."""
    early_stop: bool = False
    """A client-chosen k's chain stops early as the policy's do (``Speculation.early_stop``)."""
    logprobs: int | None = None
    """Return the target's log-probabilities of the generated tokens and this many alternatives
    each (None: none)."""
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    token_probs: list[float] = field(default_factory=list)
    """Sampling requests: the target's probability of each generated token under the processed
    row it was drawn from (0 = unknown); what a drafter's scoring call estimates its acceptance
    against. Empty when greedy."""
    synced: dict[str, int] = field(default_factory=dict)
    """Service key ('verifier' or a drafter name) -> context tokens that service holds."""
    touched: set[str] = field(default_factory=set)
    """Drafters that were ever sent this request (all get its release, synced or not)."""
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Events for the client stream (``streaming.py``: a ``Chunk`` per step, or a
    ``RequestError`` that ends it)."""
    cancelled: bool = False
    finished: bool = False
    first_token_at: float | None = None
    last_token_at: float | None = None
    scheduled_at: float | None = None
    steps: int = 0
    steps_off: int = 0
    tallies: dict[str, DrafterTally] = field(default_factory=dict)
    kv_pending: int = 0
    """KV blocks the admission counts for the request until its first verification."""
    preemptions: int = 0
    """Times the verifier dropped its cache for lack of blocks (it waited, then recomputed)."""
    lookup_scored: int = 0
    """Context tokens prompt lookup was scored on (each round scores only what came since)."""
    lookup: PromptLookupIndex = field(default_factory=PromptLookupIndex)
    """Prompt lookup over the context, kept up to date by ``lookup_index``."""
    trace: RequestTrace | None = None
    """Spans of a sampled request (``obs/tracing.py``); None when not traced."""
    translated: dict[str, TranslatedContext] = field(default_factory=dict)
    """Drafter with another tokenizer -> the context in its tokens (``router/translated.py``);
    ``synced`` counts that drafter's tokens."""

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
    def draft_tokens(self) -> int:
        return sum(t.draft_tokens for t in self.tallies.values())

    @property
    def accepted_tokens(self) -> int:
        return sum(t.accepted_tokens for t in self.tallies.values())


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
