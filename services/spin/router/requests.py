"""A request as the router tracks it: tokens, what each service holds of its context, streaming
state (incremental text, stop strings) and speculation statistics."""

from __future__ import annotations

import asyncio
import time
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
    arrival: float = field(default_factory=time.perf_counter)
    generated: list[int] = field(default_factory=list)
    synced: dict[str, int] = field(default_factory=dict)
    """Service key ('verifier' or a drafter name) -> context tokens that service holds."""
    touched: set[str] = field(default_factory=set)
    """Drafters that were ever sent this request (all get its release, synced or not)."""
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
    """Messages for the client stream (GenerateResponse, or an Exception to end it)."""
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
    """Incremental detokenization with stop strings held back until they cannot match."""

    def __init__(self, decode, stop: tuple[str, ...]) -> None:
        self.decode = decode
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.sent = 0

    def push(self, tokens: list[int], final: bool) -> tuple[str, bool]:
        """(new text to send, stop string hit) for the request's tokens so far."""
        text = self.decode(tokens)
        hits = [at for at in (text.find(s) for s in self.stop) if at >= 0]
        if hits:  # the earliest stop string in the text wins
            at = min(hits)
            delta = text[self.sent:at] if at > self.sent else ""
            self.sent = max(self.sent, at)
            return delta, True
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                end = len(text.rstrip("\ufffd"))
            end = max(self.sent, end - self.hold)
        delta = text[self.sent:end]
        self.sent = end
        return delta, False
