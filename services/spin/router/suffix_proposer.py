"""Suffix decoding as a proposer of the router's pool (``proposers.py`` has the interface and
the other kinds): model-free drafts from every request's prompt and output, computed in the
router over one bounded store (``engine/suffix_decoding.py``) shared by all its requests, and
with a ``SuffixShare`` (``stats/suffix_share.py``) by the other routers on the same Redis."""

from __future__ import annotations

from ..engine.suffix_decoding import SUFFIX_DECODING, SuffixStore
from ..engine.tree import TokenTree
from ..policy.base import StepChoice
from ..policy.outcome import Score
from ..stats.suffix_share import SuffixShare
from .proposers import Group, ModelFree, Proposals
from .requests import RouterRequest

SHARED = "shared:"
"""Key prefix, in the store, of the texts other routers published."""


class SuffixDecoding(ModelFree):
    """Model-free drafts from every request's prompt and output, in the router. The store is
    shared by all the router's requests: each request's context goes in as it grows (so a
    request also matches its own earlier text) and stays after it finishes, until the store's
    token budget evicts it (least recently used first). With a ``share``, each finished
    request's text is published to the other routers, and theirs come into the store (taken in
    as a step begins, before its lookups)."""

    name = SUFFIX_DECODING

    def __init__(self, store: SuffixStore | None = None,
                 share: SuffixShare | None = None) -> None:
        self.store = store if store is not None else SuffixStore()
        self.share = share
        self._keys: dict[str, tuple[str, int]] = {}
        """Request id -> (its sequence's key in the store, context tokens taken in); the key
        is unique per request, so a request id used again starts a sequence of its own."""
        self._scored: dict[str, int] = {}
        """Request id -> context tokens it was scored on (each round scores what came since)."""
        self._serial = 0

    def seen(self, r: RouterRequest) -> None:
        if self.share is not None:
            self._take_shared()
        key, done = self._keys.get(r.request_id, ("", 0))
        if not key:
            key, self._serial = f"{self._serial}:{r.request_id}", self._serial + 1
        prompt = len(r.prompt)
        if done < prompt:  # nothing scores the prompt's positions: no lookup per token
            self.store.extend(key, r.prompt[done:], scored=False)
            done = prompt
        if done < r.context_len:
            self.store.extend(key, r.context_from(done))
        self._keys[r.request_id] = (key, r.context_len)

    def _tail(self, r: RouterRequest) -> list[int]:
        """The context's last ``max_match`` tokens (all a lookup reads)."""
        return r.context_from(max(0, r.context_len - self.store.max_match))

    def matches(self, r: RouterRequest) -> int:
        self.seen(r)
        return self.store.branches(self._tail(r))

    def draft(self, r: RouterRequest, c: StepChoice) -> TokenTree | None:
        self.seen(r)
        return self.store.tree(self._tail(r), c.k, bool(c.branching))

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        out = Proposals()
        for r, _ in group:  # like a drafter: only the tokens since the last round
            self.seen(r)
            key = self._keys[r.request_id][0]
            start = max(len(r.prompt), self._scored.get(r.request_id, 0))
            self._scored[r.request_id] = r.context_len
            evicted = r.context_len - self.store.length(key)  # not in the store (any more)
            out.scores[r.request_id] = Score(self.name, *self.store.score(key, start - evicted))
        return out

    def _take_shared(self) -> None:
        """The other routers' texts received since the last step go into the store."""
        assert self.share is not None
        for tokens in self.share.take():
            self.store.extend(f"{SHARED}{self._serial}", tokens, scored=False)
            self._serial += 1

    def release(self, request_id: str) -> None:
        key, _ = self._keys.pop(request_id, ("", 0))  # its text stays in the store
        self._scored.pop(request_id, None)
        if self.share is not None and self.store.length(key) > self.store.min_match:
            self.share.publish(self.store.sequence(key))
