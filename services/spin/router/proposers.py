"""Proposers: everything that drafts for the router's requests, behind one interface.

A proposer (vLLM's proposers are the model) turns a group of requests, each with the policy's
``StepChoice``, into draft trees (``propose``), and can measure how well it predicts a request's
own context (``score``: the policy's prompt fit and output rounds). The scheduler and the policy
know proposers by name only: what kind a proposer is, where it runs and what it keeps per request
is this module's business. The kinds:

- ``PromptLookup``: model-free drafts from the request's own context, computed here in the router
  (no round trip; its seconds are the router's);
- ``SuffixDecoding`` (``suffix_proposer.py``): model-free drafts from every request's prompt and
  output, in the router too: one bounded store (``engine/suffix_decoding.py``) shared by all the
  router's requests;
- ``ModelDrafter``: a draft model served by ``spin drafter`` replicas (``services.Drafter``: a
  ``ReplicaPool`` that records what each replica holds of each request and what it must free);
- ``TranslatedDrafter``: a draft model with another tokenizer, drafting through token translation
  (the router keeps each request's context in the drafter's tokens: ``engine/translate.py``);
- ``DraftHead``: an EAGLE-3 head inside the verifier (``engine/head_runner.py``): it drafts a
  request's next chain right after the request's verdict, in the same call (``Proposals.asks``
  ride on the verification task; ``verified`` reads the chain back).

``Proposers`` is the registry the scheduler reads: the router's local proposers and one drafter
proposer per drafter service, live over the services that discovery adds and removes. A new kind
is a class here and a line in ``Proposers``; the scheduler does not change.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from ..engine.head_runner import HeadAsk
from ..engine.prompt_lookup import PROMPT_LOOKUP, lookup_tree
from ..engine.sampling import SamplingParams
from ..engine.translate import TranslatedContext, Translator
from ..engine.tree import TokenTree
from ..policy.base import StepChoice
from ..policy.outcome import Score
from .requests import RouterRequest
from .services import DraftResult, DraftTask, Drafter, ServiceDown, VerifyResult

log = logging.getLogger(__name__)
Group = list[tuple[RouterRequest, StepChoice]]
"""The requests a proposer serves in one call, each with its choice."""
PROMPT_SCORE_POSITIONS = 512
"""Prompt positions (its tail) a drafter scores at a request's first step."""
GREEDY = SamplingParams()
"""What a translated drafter drafts with: its most likely tokens."""


@dataclass
class Proposals:
    """A proposer's answer for one call."""

    trees: dict[str, TokenTree] = field(default_factory=dict)
    """Request id -> its draft (requests without one are absent)."""
    scores: dict[str, Score] = field(default_factory=dict)
    """Request id -> its score (``score`` calls)."""
    seconds: float = 0.0
    """The proposer's own seconds for the call (a service's, or the router's for a local one)."""
    remote: bool = False
    """A service answered (its health and its seconds count as a drafter call's)."""
    failed: bool = False
    """The service did not answer: its requests draft nothing this step."""
    asks: dict[str, HeadAsk] = field(default_factory=dict)
    """Request id -> what its verification task asks of a draft head."""


class Proposer(abc.ABC):
    """Drafts (and scores) for requests; one instance per drafter name."""

    name: str
    can_score: bool = True
    """Its predictions are in the target's tokens, so it can score a request's context."""
    in_verifier: bool = False
    """It drafts inside the verifier (a draft head: no prompt score, no call of its own)."""
    model_free: bool = False
    """It drafts in the router with no model (``engine/model_free.py``): the policy asks it
    only when it finds a match (``matches``)."""

    @property
    @abc.abstractmethod
    def available(self) -> bool:
        """It can be asked now."""

    @abc.abstractmethod
    async def propose(self, group: Group, timeout_s: float) -> Proposals:
        """A draft of ``choice.k`` levels (``choice.branching``) for each request of ``group``."""

    @abc.abstractmethod
    async def score(self, group: Group, timeout_s: float) -> Proposals:
        """How well it predicts each request's context since its last score (``Proposals.
        scores``); a drafter keeps the prefill for later drafts."""

    def matches(self, r: RouterRequest) -> int:
        """Continuations it would draft for ``r`` now that begin differently (0: none, it would
        draft nothing; a model-free proposer looks, the others answer 1)."""
        return 1

    def seen(self, r: RouterRequest) -> None:
        """``r``'s context as it stands (each step, and once more when it finishes): a proposer
        that learns from every request's text takes in what is new."""

    def release(self, request_id: str) -> None:
        """The request is done: forget what is kept for it (freed with the next call)."""

    @property
    def pending_releases(self) -> bool:
        """Releases wait for a call."""
        return False

    async def flush(self) -> None:
        """Send pending releases now (the router idles)."""

    def verified(self, results: Mapping[str, VerifyResult]) -> None:
        """The verdicts of the requests it proposed for this step (request id -> result)."""


class ModelFree(Proposer):
    """A model-free proposer: its drafts are computed here in the router (its seconds are the
    router's), from text it keeps, with no service to call."""

    model_free = True

    @property
    def available(self) -> bool:
        return True

    @abc.abstractmethod
    def draft(self, r: RouterRequest, c: StepChoice) -> TokenTree | None:
        """``r``'s draft for ``c`` (None: no match)."""

    async def propose(self, group: Group, timeout_s: float) -> Proposals:
        out = Proposals()
        start = time.perf_counter()
        for r, c in group:
            tree = self.draft(r, c)
            if tree is not None:
                out.trees[r.request_id] = tree
        out.seconds = time.perf_counter() - start
        return out


class PromptLookup(ModelFree):
    """Model-free drafts from the request's own context, in the router."""

    name = PROMPT_LOOKUP

    def __init__(self) -> None:
        self._scored: dict[str, int] = {}
        """Request id -> context tokens it was scored on (each round scores what came since)."""

    def draft(self, r: RouterRequest, c: StepChoice) -> TokenTree | None:
        return lookup_tree(r.lookup_index(), c.k, bool(c.branching))

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        out = Proposals()
        for r, _ in group:  # like a drafter: only the tokens since the last round
            start = max(len(r.prompt), self._scored.get(r.request_id, 0))
            self._scored[r.request_id] = r.context_len
            out.scores[r.request_id] = Score(self.name, *r.lookup_index().score(start))
        return out

    def matches(self, r: RouterRequest) -> int:
        index = r.lookup_index()
        return 1 + bool(index.alternative(1)) if index.has_match() else 0

    def release(self, request_id: str) -> None:
        self._scored.pop(request_id, None)


class ModelDrafter(Proposer):
    """A draft model's service: its replicas keep each request's context (``keep`` + delta)."""

    def __init__(self, name: str, service: Drafter) -> None:
        self.name = name
        self.service = service

    @property
    def available(self) -> bool:
        return self.service.available

    async def propose(self, group: Group, timeout_s: float) -> Proposals:
        return await self._call(group, timeout_s)

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        return await self._call([(r, StepChoice(self.name, 0, score=(self.name,)))
                                 for r, _ in group], timeout_s)

    def release(self, request_id: str) -> None:
        self.service.release([request_id])

    @property
    def pending_releases(self) -> bool:
        return self.service.pending_releases

    async def flush(self) -> None:
        await self.service.flush()

    async def _call(self, group: Group, timeout_s: float) -> Proposals:
        """One call for ``group`` (the pending releases ride along); a failed call drafts
        nothing, and what the replicas hold of its requests is unknown from then on."""
        tasks = [self._task(r, c) for r, c in group]
        try:
            reply = await self.service.draft(tasks, timeout_s)
        except ServiceDown as e:
            log.warning("drafting without %s this step: %s", self.name, e)
            for r, _ in group:
                self.service.forget(r.request_id)
            return Proposals(remote=True, failed=True)
        out = Proposals(seconds=reply.draft_seconds, remote=True)
        for (r, c), res in zip(group, reply.results):
            if res.resync:
                self.service.forget(r.request_id)
            elif res.score_positions:
                out.scores[r.request_id] = _score(self.name, res)
            elif res.tree is not None and len(res.tree):
                tree = self._tree(r, c, res.tree)
                if tree is not None:
                    out.trees[r.request_id] = tree
        return out

    def _task(self, r: RouterRequest, c: StepChoice) -> DraftTask:
        """``r``'s task: the context the replica lacks, and a draft (k > 0) or a score."""
        keep = self.service.keep(r.request_id, r.prompt)
        self.service.hold(r.request_id, r.context_len)
        scoring = c.k <= 0 and bool(c.score)
        probs = (r.context_probs_from(keep)
                 if scoring and r.generated and not r.sampling.greedy else [])
        return DraftTask(r.request_id, keep, r.context_from(keep), c.k, r.sampling, c.branching,
                         r.traceparent, r.tracestate, scoring,
                         _score_from(r) if scoring else 0, c.stop_below, probs)

    def _tree(self, r: RouterRequest, c: StepChoice, tree: TokenTree) -> TokenTree | None:
        """The draft as the verifier takes it."""
        return tree


class TranslatedDrafter(ModelDrafter):
    """A draft model with another tokenizer. The router keeps each request's context in its
    tokens (``keep`` and the delta count draft tokens), asks it for a greedy chain whatever the
    request samples with (the verifier checks the translated tokens as one-hot drafts, which is
    exact for any sampling), and hands the verifier the chain re-tokenised into at most ``k``
    target tokens. Its predictions are in its own tokens, so it scores nothing."""

    can_score = False

    def __init__(self, name: str, service: Drafter, translator: Translator) -> None:
        super().__init__(name, service)
        self.translator = translator
        self._contexts: dict[str, TranslatedContext] = {}
        """Request id -> its context in the drafter's tokens."""

    def release(self, request_id: str) -> None:
        super().release(request_id)
        self._contexts.pop(request_id, None)

    def _task(self, r: RouterRequest, c: StepChoice) -> DraftTask:
        ctx = self._contexts.get(r.request_id)
        if ctx is None:
            ctx = self._contexts[r.request_id] = self.translator.context()
            self.service.forget(r.request_id)  # what it holds was not sent in its own tokens
        ctx.extend(r.context_from(ctx.seen))
        keep, delta = ctx.sync(self.service.keep(r.request_id, r.prompt))
        self.service.hold(r.request_id, len(ctx.draft))
        return DraftTask(r.request_id, keep, list(delta), c.k, GREEDY,
                         traceparent=r.traceparent, tracestate=r.tracestate,
                         stop_below=c.stop_below)

    def _tree(self, r: RouterRequest, c: StepChoice, tree: TokenTree) -> TokenTree | None:
        """The drafted chain as a chain of at most ``k`` target tokens; None when it translates
        to nothing (or translation fails: that costs the step's draft, never the request)."""
        ctx = self._contexts.get(r.request_id)
        try:
            tokens = ctx.propose(list(tree.tokens), c.k) if ctx is not None else []
        except Exception as e:  # noqa: BLE001 - a tokenizer's surprise is no reason to fail
            log.warning("request %s: %s's draft did not translate: %r", r.request_id, self.name, e)
            return None
        return TokenTree.chain(tokens) if tokens else None


class DraftHead(Proposer):
    """A draft head inside the verifier. Its proposal for a step is the chain it drafted right
    after the request's previous verdict (the tokens kept here, their distributions in the
    verifier); each step asks for the next chain. A request's first step with it (no chain yet)
    is a plain step that asks."""

    can_score = False
    in_verifier = True

    def __init__(self, name: str, available: Callable[[], bool]) -> None:
        """``available``: whether the verifier can be asked."""
        self.name = name
        self._available = available
        self._drafts: dict[str, tuple[int, list[int]]] = {}
        """Request id -> (the context length it was drafted at, the chain)."""
        self._asked: dict[str, int] = {}
        """Request id -> its context length when this step asked."""

    @property
    def available(self) -> bool:
        return self._available()

    async def propose(self, group: Group, timeout_s: float) -> Proposals:
        out = Proposals()
        for r, c in group:
            at, chain = self._drafts.pop(r.request_id, (-1, []))
            n = min(c.k, len(chain)) if at == r.context_len else 0
            if n:
                out.trees[r.request_id] = TokenTree.chain(chain[:n])
            out.asks[r.request_id] = HeadAsk(self.name, k=c.k if c.ask is None else c.ask,
                                             stored=n)
            self._asked[r.request_id] = r.context_len
        return out

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        return Proposals()

    def verified(self, results: Mapping[str, VerifyResult]) -> None:
        for rid, res in results.items():
            at = self._asked.pop(rid, None)
            if at is not None and res.tokens and res.head_draft:
                self._drafts[rid] = (at + len(res.tokens), list(res.head_draft))

    def release(self, request_id: str) -> None:
        self._drafts.pop(request_id, None)
        self._asked.pop(request_id, None)


class Proposers(Mapping[str, Proposer]):
    """The registry: name -> proposer. The local proposers, then one per drafter service, live
    over ``drafters`` (discovery adds and removes services; the router's tokenizer checks add
    ``translators`` for drafters with another tokenizer)."""

    def __init__(self, drafters: Mapping[str, Drafter],
                 translators: dict[str, Translator] | None = None,
                 local: tuple[Proposer, ...] | None = None) -> None:
        """``local``: the router's own proposers (None: prompt lookup)."""
        self.drafters = drafters
        self.translators = translators if translators is not None else {}
        self.local = {p.name: p for p in (local if local is not None else (PromptLookup(),))}
        self._made: dict[str, tuple[Drafter, Translator | None, Proposer]] = {}
        """name -> the service and translator its proposer was made for, and the proposer."""

    def __getitem__(self, name: str) -> Proposer:
        if name in self.local:
            return self.local[name]
        service, translator = self.drafters[name], self.translators.get(name)
        made = self._made.get(name)
        if made is None or made[0] is not service or made[1] is not translator:
            # a new service, or its tokenizer check found it needs translation
            proposer = (TranslatedDrafter(name, service, translator) if translator is not None
                        else ModelDrafter(name, service))
            made = self._made[name] = (service, translator, proposer)
        return made[2]

    def __iter__(self) -> Iterator[str]:
        yield from self.local
        yield from (n for n in self.drafters if n not in self.local)

    def __len__(self) -> int:
        return len(self.local) + sum(1 for n in self.drafters if n not in self.local)


def _score(name: str, res: DraftResult) -> Score:
    """A drafter's score (its acceptance estimate only where it covers every scored token)."""
    return Score(name, res.score_matches, res.score_positions,
                 res.score_acceptance if res.score_acceptance_positions == res.score_positions
                 else None)


def _score_from(r: RouterRequest) -> int:
    """First context position a drafter scores: the output, or the prompt before there is any
    (how well a drafter predicts the prompt ranks the drafters' fit to the request)."""
    return len(r.prompt) if r.generated else max(1, len(r.prompt) - PROMPT_SCORE_POSITIONS)
