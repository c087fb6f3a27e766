"""How much of k early-stopping chains draft, per model drafter.

A chain given ``stop_below`` (``StepChoice.stop_below``) stops once its probability, the product
of its tokens' draft probabilities, falls below that line, so k is only its longest length. On
the demo family's 144 held-out prompts (the target's greedy output, 64 tokens each), a draft
token its drafter gives probability 0.9 or more is the target's 90-99% of the time, one under 0.1
only 1-29%. The scheduler passes the policy the length drafted (as ``choice.k``), and the step
time a policy predicts (``StepPrediction``) scales k by the fraction of k that drafter's chains
drafted lately, a moving average over its steps.
"""

from __future__ import annotations

from .base import StepChoice

EMA = 0.1
"""Weight of a step in the moving average."""


class ChainLength:
    """Per model drafter, the moving average of drafted / k over its early-stopping chains."""

    def __init__(self) -> None:
        self._fraction: dict[str, float] = {}
        """drafter -> moving average of the fraction of k drafted (1 before any step)"""
        self._cap: dict[str, int] = {}
        """request id -> the k its early-stopping chain was given this step"""

    def expected_k(self, choice: StepChoice) -> float:
        """The length ``choice`` is expected to draft: k, scaled for an early-stopping chain."""
        if not choice.stop_below or choice.drafter is None:
            return float(choice.k)
        return choice.k * self._fraction.get(choice.drafter, 1.0)

    def chosen(self, request_id: str, choice: StepChoice) -> None:
        """The request's step runs ``choice``; only early-stopping chains are followed."""
        if choice.stop_below and choice.drafter is not None and choice.k > 0:
            self._cap[request_id] = choice.k

    def observe(self, request_id: str, choice: StepChoice) -> None:
        """The request's step drafted ``choice.k`` tokens with ``choice.drafter``."""
        cap = self._cap.pop(request_id, None)
        if cap and choice.drafter is not None:
            f = self._fraction.get(choice.drafter, 1.0)
            self._fraction[choice.drafter] = f + EMA * (min(choice.k, cap) / cap - f)

    def release(self, request_id: str) -> None:
        self._cap.pop(request_id, None)
