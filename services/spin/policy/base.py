"""The one interface through which the router asks which drafter and k each request uses.

Every step the router hands the policy a view of each running request and the set of drafters that
are reachable now; the policy answers one ``StepChoice`` per request. After verification the router
reports what happened, one ``outcome.StepOutcome`` per step (``observe``), so learning policies
can update. A choice naming a drafter
that is not available is never made: the router would have nothing to run it on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from ..engine.model_free import MODEL_FREE
from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..timing.cost_model import CostModel
from .choice import StepChoice, StepPlan, StepPrediction
from .loss_guard import StepKind
from .outcome import StepOutcome

__all__ = ["MODEL_FREE", "PROMPT_LOOKUP", "FixedPolicy", "Policy", "RequestView", "StepChoice",
           "StepPlan", "StepPrediction", "branches", "unmatched"]


@dataclass(frozen=True)
class RequestView:
    """What a policy may know about one running request."""

    request_id: str
    context_len: int
    """Prompt + generated tokens."""
    generated: int
    """Tokens generated so far."""
    remaining: int
    """Tokens still allowed (max_tokens - generated)."""
    greedy: bool
    """Temperature 0."""
    mode: Literal["auto", "off", "drafter"] = "auto"
    """The client's speculation setting."""
    drafter: str | None = None
    """The client's drafter for mode 'drafter'."""
    k: int = 0
    """The client's k for mode 'drafter' (0 = the policy's)."""
    early_stop: bool = False
    """The client's k is the longest chain: a model drafter's chain stops early as the policy's
    do (``StepChoice.stop_below``)."""
    lookup_match: bool = True
    """Prompt lookup finds a match in the request's context now, so it would draft this step
    (the router looks before it asks)."""
    lookup_branches: int = 1
    """Continuations prompt lookup found that begin differently (2: it could draft a tree)."""
    free_branches: tuple[tuple[str, int], ...] = ()
    """The other model-free drafters' (suffix decoding's): (name, continuations it found that
    begin differently), 0 = no match (it would draft nothing this step); one not listed is
    taken to find one continuation."""
    cached: int = 0
    """Tokens of the prompt the verifier's prefix cache likely holds (the router's guess): a
    prefill computes only the rest."""


def branches(r: RequestView, drafter: str) -> int:
    """Continuations model-free ``drafter`` would draft for ``r`` this step that begin
    differently (0: none, it is no candidate; 2: it could draft a tree)."""
    if drafter == PROMPT_LOOKUP:
        return r.lookup_branches if r.lookup_match else 0
    return next((n for name, n in r.free_branches if name == drafter), 1)


def unmatched(r: RequestView) -> set[str]:
    """The model-free drafters that would draft nothing for ``r`` this step."""
    return {d for d in MODEL_FREE if not branches(r, d)}


class Policy(Protocol):
    def choose(self, requests: list[RequestView], available: set[str],
               heads: frozenset[str] = frozenset()) -> StepPlan:
        """One choice per request, in order, using only drafters in ``available``, and the
        step's predicted cost. ``heads``: those of ``available`` that draft inside the
        verifier (they score no prompt: every request may try them)."""
        ...

    def observe(self, outcome: StepOutcome) -> None:
        """What a verified step did (``outcome.py``): the one report of a step."""
        ...

    def release(self, request_id: str) -> None:
        """The request finished or was cancelled."""
        ...

    def measured(self) -> Mapping[StepKind, tuple[float, float, bool]]:
        """Per kind of step: tokens per second measured speculating and not, and whether the
        policy speculates there now (``loss_guard.py``); empty for a policy that measures
        nothing."""
        ...

    def calibration(self) -> Mapping[tuple[str, str], float]:
        """The cost model's corrections learnt in serving: (part, model drafter) -> measured /
        predicted seconds (``calibration.py``); empty for a policy without a cost model."""
        ...

    def set_cost_model(self, cost: CostModel | None) -> None:
        """Plan with this ``CostModel`` from now on (the router fitted a new one: a drafter
        joined)."""
        ...


@dataclass
class FixedPolicy:
    """The same drafter and k for every request that does not name its own.

    A request's own drafter (mode 'drafter') wins; when the wanted drafter is down the request
    falls back to prompt lookup (always available: it runs in the router) with the same k, or to
    k = 0 when prompt lookup is not wanted either. Mode 'off' always gets k = 0.
    """

    drafter: str | None = PROMPT_LOOKUP
    """Default drafter (None: no speculation unless a request asks for it)."""
    k: int = 4
    """Default speculation length."""
    fallback: str | None = PROMPT_LOOKUP
    """Used when the wanted drafter is not available (None = k = 0)."""

    def choose(self, requests: list[RequestView], available: set[str],
               heads: frozenset[str] = frozenset()) -> StepPlan:
        out = StepPlan()
        for r in requests:
            if r.mode == "off":
                out.append(StepChoice(None))
                continue
            name = r.drafter if r.mode == "drafter" else self.drafter
            k = (r.k or self.k) if r.mode == "drafter" else self.k
            if name is not None and name not in available:
                name = self.fallback if self.fallback in available else None
            k = min(k, r.remaining - 1)
            out.append(StepChoice(name, k) if name is not None and k > 0 else StepChoice(None))
        return out

    def observe(self, outcome: StepOutcome) -> None:
        return None

    def release(self, request_id: str) -> None:
        return None

    def measured(self) -> Mapping[StepKind, tuple[float, float, bool]]:
        return {}

    def calibration(self) -> Mapping[tuple[str, str], float]:
        return {}

    def set_cost_model(self, cost: CostModel | None) -> None:
        return None
