"""What the policy answers for a step: a ``StepChoice`` per request, in a ``StepPlan`` with the
cost model's ``StepPrediction`` of the step."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StepChoice:
    """What one request does in one step."""

    drafter: str | None
    """Drafter name; None = no speculation this step (k = 0)."""
    k: int = 0
    """Speculation length (tree depth)."""
    branching: tuple[int, ...] = ()
    """Tree shape: children per node per level; () = a chain."""
    score: tuple[str, ...] = ()
    """Drafters (model drafters and prompt lookup) that should also score the request's own
    output this step: how well each predicts it, answered in the step's ``outcome.StepOutcome``. A
    model drafter keeps the prefill for later drafts."""
    stop_below: float = 0.0
    """A model drafter's chain stops early once its probability (the product of its tokens'
    draft probabilities) falls below this, so ``k`` is at most the chain's length; 0 = always
    ``k``. ``Policy.observe`` gets the length drafted."""
    ask: int | None = None
    """A draft head: tokens it drafts right after this step's verdict, for the request's next
    step (None: ``k``). 0: the step verifies the chain the head drafted for it (``k`` of its
    tokens) and asks for none."""


@dataclass(frozen=True)
class StepPrediction:
    """The cost model's account of one chosen step (``StepPlan.prediction``)."""

    step_s: float
    """Predicted step seconds: drafting + verification + ``scoring_s`` (drafting and the rest
    overlap when pipelined)."""
    draft_s: dict[str, float]
    """Predicted seconds of each drafter's call (drafters with a drafting request only)."""
    verify_s: float
    """Predicted seconds of the verification call."""
    scoring_work: tuple[int, int] = (0, 0)
    """(calls, tokens fed) of the model drafters' scoring calls this step, which run during the
    verification: work the cost model does not count (prompt lookup scores in the router,
    before it)."""
    scoring_s: float = 0.0
    """Predicted seconds those calls add to the verification (in ``step_s``, not ``verify_s``)."""
    plain_s: float = math.nan
    """Predicted seconds of the same batch with no request speculating (no drafting, no
    scoring): what the step's speculation is weighed against."""
    prefill_tokens: int = 0
    """Prompt tokens the verification prefills besides the requests' k + 1."""
    tokens: float = math.nan
    """Expected tokens the step emits (Σ over requests of E(a, k) at their acceptance
    estimates); with ``plain_s``, the predicted gain is ``tokens / step_s`` over
    ``batch / plain_s``."""


class StepPlan(list):
    """A policy's answer for one step: one ``StepChoice`` per request, in order (it is that
    list), and the cost model's account of the step it chose."""

    def __init__(self, choices: Iterable[StepChoice] = (),
                 prediction: StepPrediction | None = None, hold: int = 1) -> None:
        super().__init__(choices)
        self.prediction = prediction
        """None without a cost model, or when the policy chose no request's k (every request in
        mode off, or naming its drafter and k)."""
        self.hold = hold
        """Plain forwards the policy lets a plan in which no request drafts or scores run in
        one call before it decides again (the loss guard's plain steps until its next probe);
        the scheduler runs at most ``SchedulerConfig.plain_steps``."""
