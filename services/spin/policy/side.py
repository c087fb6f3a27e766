"""One side of the loss guard's comparison (``loss_guard.py``): the discounted tokens and
seconds of the steps that speculated, or of those that did not, their rate (tokens per second of
step) and its standard error by the delta method (a ratio of discounted sums)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Side:
    """Discounted tokens and seconds of one side's steps."""

    tokens: float = 0.0
    seconds: float = 0.0
    weight: float = 0.0
    """Discounted count of the steps."""
    steps: int = 0
    squares: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    """Discounted sums of tokens², tokens x seconds and seconds² of the steps, and of the
    squared weights (decay² a step): the rate's standard error (``variance``)."""

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.weight = decay * self.weight + 1.0
        tt, ts, ss, w2 = self.squares
        self.squares = (decay * tt + tokens * tokens, decay * ts + tokens * seconds,
                        decay * ss + seconds * seconds, decay * decay * w2 + 1.0)
        self.steps += 1

    @property
    def variance(self) -> float:
        """The variance of ``rate``, a ratio of sums: the weighted mean square of the steps'
        residuals tokens - rate x seconds, times the sum of squared weights, over the squared
        sum of seconds (the delta method; 0 before two steps)."""
        if self.steps < 2 or self.seconds <= 0:
            return 0.0
        tt, ts, ss, w2 = self.squares
        r = self.rate
        residual = max(0.0, tt - 2 * r * ts + r * r * ss) / self.weight
        return residual * w2 / (self.seconds * self.seconds)

    def prior(self, steps: int) -> Side:
        """This side's rate and spread as a prior worth at most ``steps`` steps (no steps of
        its own): its sums scaled to that weight, its effective count set to it."""
        w = min(float(steps), self.weight)
        if w <= 0:
            return Side()
        f = w / self.weight
        tt, ts, ss, _ = self.squares
        return Side(f * self.tokens, f * self.seconds, w, 0, (f * tt, f * ts, f * ss, w))

    def charge(self, seconds: float) -> None:
        """Seconds this side's steps cost outside them (no tokens, no step)."""
        self.seconds += seconds

    @property
    def step_s(self) -> float:
        """Mean seconds of a step."""
        return self.seconds / self.weight if self.weight > 0 else 0.0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0
