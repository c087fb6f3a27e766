"""The router's side of drafters whose tokenizer is not the target's (token translation).

Such a drafter is kept when the router can load its tokenizer (``server.py``); the router then
holds each request's context in the drafter's tokens too (``RouterRequest.translated``, one
``engine.translate.TranslatedContext`` per drafter), sends it those tokens (``keep`` and
``context_delta`` count draft tokens), asks it for a greedy chain whatever the request samples
with (the verifier checks the translated tokens as one-hot drafts, which is exact for any
sampling), and hands the verifier the chain re-tokenised into at most ``k`` target tokens. The
step is accounted like any other: the drafted tokens are the target tokens sent.

Such a drafter scores nothing: the policy's prompt fit and scoring compare predictions in target
tokens, so its scoring tasks are not sent (the policy sees no score from it).
"""

from __future__ import annotations

import logging

from ..engine.sampling import SamplingParams
from ..engine.translate import TranslatedContext, Translator
from ..engine.tree import TokenTree
from ..policy.base import StepChoice
from .requests import RouterRequest
from .services import DraftTask, Service

log = logging.getLogger(__name__)
GREEDY = SamplingParams()
"""What a translated drafter drafts with: its most likely tokens."""


class TranslatedDrafters:
    """The translators of the drafters with another tokenizer, by drafter name (shared with the
    router's drafter checks, which add them as drafters appear)."""

    def __init__(self, translators: dict[str, Translator] | None = None) -> None:
        self.translators = translators if translators is not None else {}

    def __contains__(self, name: str) -> bool:
        return name in self.translators

    def context(self, r: RouterRequest, name: str) -> TranslatedContext:
        """The request's context in ``name``'s tokens, up to date with its target tokens."""
        ctx = r.translated.get(name)
        if ctx is None:
            ctx = r.translated[name] = self.translators[name].context()
            r.synced.pop(name, None)  # anything it holds was not sent in its own tokens
        ctx.extend(r.context_from(ctx.seen))
        return ctx

    def task(self, drafter: Service, r: RouterRequest, c: StepChoice, name: str) -> DraftTask:
        """The draft task for request ``r`` (a greedy chain of ``c.k`` draft tokens), its context
        in draft tokens; ``r.synced[name]`` counts draft tokens."""
        ctx = self.context(r, name)
        keep, delta = ctx.sync(drafter.route(r.request_id, r.synced.get(name, 0)))
        r.synced[name] = len(ctx.draft)
        return DraftTask(r.request_id, keep, list(delta), c.k, GREEDY,
                         traceparent=r.traceparent, tracestate=r.tracestate,
                         stop_below=c.stop_below)

    def tree(self, r: RouterRequest, name: str, tree: TokenTree, k: int) -> TokenTree | None:
        """The drafted chain as a chain of at most ``k`` target tokens; None when it translates
        to nothing (or translation fails: that costs the step's draft, never the request)."""
        ctx = r.translated.get(name)
        try:
            tokens = ctx.propose(list(tree.tokens), k) if ctx is not None else []
        except Exception as e:  # noqa: BLE001 - a tokenizer's surprise is no reason to fail
            log.warning("request %s: %s's draft did not translate: %r", r.request_id, name, e)
            return None
        if not tokens:
            return None
        return TokenTree.chain(tokens)
