"""What scoring calls add to a step, learned while serving.

The learned policy asks model drafters to score a request's prompt or output (``learned.py``):
every drafter prefills the prompt at a request's first step, and later rounds score a few new
tokens. The router sends those calls while the target verifies, and the step ends when both are
done. On a GPU they share the device with the verification, on a CPU its cores; either way the
step takes longer than the cost model's verification alone, which was fitted on bare forwards
(``spin profile``). On the demo family on a 2-core machine the first step of a request took
22-70 ms longer than predicted and a round of one or two drafters scoring about 12 tokens 1-19 ms
longer; those steps made most of the serving prediction error.

The extra seconds are modelled as linear in the scoring calls and the tokens they feed::

    t_extra = a · calls + b · tokens / 100

fitted online by recursive least squares with forgetting (each step's measured verification part
minus the predicted verification), so the fit follows the deployment; it predicts nothing (0 s)
until it has seen a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class ScoringCost:
    """Seconds that scoring calls add to a step (module doc). Not thread-safe (the router's
    scheduler calls the policy from one event loop)."""

    forget: float = 0.98
    """Weight of the earlier steps against the latest, per step (1 = never forget)."""
    prior_variance: float = 1.0
    """Initial variance of the coefficients (large against their size: the first steps decide)."""
    _theta: np.ndarray = field(default_factory=lambda: np.zeros(2), repr=False)
    """[a, b]: seconds per call, seconds per 100 tokens fed"""
    _p: np.ndarray = field(init=False, repr=False)
    """Inverse information matrix of the least-squares fit, shape [2, 2]"""
    steps: int = 0
    """Steps observed."""

    def __post_init__(self) -> None:
        if not 0.0 < self.forget <= 1.0:
            raise ValueError(f"forget={self.forget} outside (0, 1]")
        self._p = np.eye(2) * self.prior_variance

    @staticmethod
    def _features(calls: int, tokens: int) -> np.ndarray:
        return np.array([float(calls), tokens / 100.0])                           # [2]

    def predict(self, calls: int, tokens: int) -> float:
        """Seconds that ``calls`` scoring calls feeding ``tokens`` tokens in all add to a step."""
        if calls <= 0 or self.steps == 0:
            return 0.0
        return max(0.0, float(self._features(calls, tokens) @ self._theta))

    def observe(self, calls: int, tokens: int, seconds: float) -> None:
        """A served step with ``calls`` scoring calls feeding ``tokens`` took ``seconds`` longer
        than its verification alone was predicted to."""
        if calls <= 0 or not np.isfinite(seconds):
            return
        x = self._features(calls, tokens)                                         # [2]
        px = self._p @ x                                                          # [2]
        gain = px / (self.forget + x @ px)                                        # [2]
        self._theta = self._theta + gain * (seconds - x @ self._theta)
        self._p = (self._p - np.outer(gain, px)) / self.forget
        self.steps += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(seconds per call, seconds per 100 tokens fed)."""
        return float(self._theta[0]), float(self._theta[1])
