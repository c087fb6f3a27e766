"""What one verified step did: one record the router builds and everything after it reads.

The scheduler verifies a micro-batch and builds one ``StepOutcome`` (vLLM's ``SpecDecodingStats``
is the model): per request what was chosen and drafted, what was accepted and emitted, what the
drafters that scored it measured, and for the step its times and the policy's prediction of them.
The policy learns from it (``Policy.observe``), the router's accounting turns it into metrics and
acceptance statistics, and each request's stream message carries its part; none of them calls
another.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ..engine.tree import TokenTree
from .choice import StepChoice, StepPrediction


@dataclass(frozen=True)
class Score:
    """How well one drafter predicted a request's context (``StepChoice.score``)."""

    drafter: str
    matches: int
    """Scored positions where the drafter's greedy prediction was the context's token."""
    positions: int
    """Context positions scored."""
    accepted: float | None = None
    """Sampling requests: the draft tokens a sampled draft would get accepted at those positions,
    estimated from the target's probabilities (None: no estimate)."""


@dataclass(frozen=True)
class TreeOutcome:
    """What one greedy step's verification says about the drafter's ranks."""

    first_accepted: int
    """Levels accepted through first-ranked children from the root: the chain's acceptance
    evidence (a tree's second-ranked acceptances do not count toward alpha)."""
    trials: int
    """Levels where the first-ranked token was rejected and a second-ranked one was known."""
    hits: int
    """Of them, those where the target's token was the second-ranked one."""


def outcome(tree: TokenTree, tokens: tuple[int, ...] | list[int], accepted: int) -> TreeOutcome:
    """The rank evidence of a verified greedy step: ``tokens`` emitted (``accepted`` draft
    tokens, then the target's own), the drafted ``tree`` (children listed best first)."""
    trials = hits = 0
    first, on_first, node = 0, True, -1
    for level in range(accepted + 1):
        want = tokens[level]
        kids = tree.children(node)
        if not kids:
            break
        if tree.tokens[kids[0]] == want:
            node = kids[0]
            first += on_first
            continue
        on_first = False
        second = (tree.tokens[kids[1]] if len(kids) > 1
                  else tree.second[kids[0]] if tree.second else -1)
        if second >= 0:
            trials += 1
            hits += second == want
        if len(kids) > 1 and second == want:
            node = kids[1]
            continue
        break
    return TreeOutcome(first, trials, hits)


@dataclass(frozen=True)
class RequestOutcome:
    """One request's part of a verified step."""

    request_id: str
    greedy: bool
    """Temperature 0 (its statistics are kept apart from sampling requests')."""
    choice: StepChoice
    """What it drafted with: the policy's choice, its k cut to the chain drafted when an early
    stopping chain stopped short; ``StepChoice(None)`` when no draft came (k = 0, no match,
    a failed drafter)."""
    drafted: int = 0
    """Draft tokens verified (tree nodes)."""
    accepted: int = 0
    """Of those, accepted."""
    emitted: int = 0
    """Tokens the step gave the request (accepted + the target's own, cut at its end)."""
    verified: bool = False
    """The verifier verified it (False: resync, preemption, or cancelled meanwhile)."""
    ranks: TreeOutcome | None = None
    """Greedy drafts: what the verification says of the drafter's ranks."""
    scores: tuple[Score, ...] = ()
    """Drafters that scored the request this step."""
    asked: bool = False
    """A draft head drafted the request's next chain in this step though it verified none of
    its own (its first step with the head): speculation's cost without a draft."""


@dataclass(frozen=True)
class StepOutcome:
    """A micro-batch's verified step."""

    requests: tuple[RequestOutcome, ...]
    prediction: StepPrediction | None = None
    """The policy's prediction of this step (None: none was made)."""
    draft_wait_s: float = 0.0
    """The router's wait for the drafts (local proposers included), round trips included."""
    verify_wait_s: float = 0.0
    """The router's wait for the verification, round trip included."""
    step_s: float = 0.0
    """The whole step, the router's own work included."""
    draft_s: Mapping[str, float] = field(default_factory=dict)
    """Each drafter called: its own seconds for the call (prompt lookup: the router's)."""
    verify_s: float = 0.0
    """The verifier's own seconds for the batch."""
    drafters_called: Mapping[str, bool] = field(default_factory=dict)
    """Drafter services called this step -> whether they answered."""
    forwards: int = 1
    """Target forwards the call ran for a request at most: several for plain steps held
    (``StepPlan.hold``) or with speculation off; the step's tokens and seconds are all of
    them."""

    @property
    def batch_size(self) -> int:
        return len(self.requests)

    @property
    def rest_s(self) -> float:
        """The step but its drafting: verification, round trips and the router's work (the
        drafters run concurrently: the slowest counts)."""
        return self.step_s - max(self.draft_s.values(), default=0.0)
