"""How much requests differ in a drafter's acceptance: the strength of the prior a request's own
estimate is shrunk toward (empirical Bayes).

A sampling request's drafts are accepted at a rate of its own, and its steps are exchangeable:
on tuning prompts (sampled, temperature 0.8, 36 requests of the demo's EAGLE head at k = 4, a
router step trace of ``spin bench learned --passes 4``) the accepted count of one step and the
next, less the request's mean, correlate at 0.02, while the requests' rates ranged 0.53-0.94
(variance 0.0138, of which 0.0033 is the sampling noise of 57 trials each). So the best estimate
of a request's rate is its own accepted tokens and rejections, *all* of them, plus the
population's rate worth ``m`` trials, where ``m`` says how alike requests are: with the rates
Beta-distributed around the population's mean ``a``, ``m = a (1 - a) / v - 1`` for the
variance ``v`` between requests (the method of moments: the variance of the released
requests' rates less their mean sampling variance ``a_r (1 - a_r) / n_r``). That run measured
``m`` = 18 trials for the head, 0.4-10.5 for the model drafters and prompt lookup (9 requests
each in the warm-up), against the 2 trials of the discounted estimate's seed before, which let
one step accepting nothing move the head's estimate from 0.70 to 0.60, below its break-even on
this CPU: 28% of the learned policy's steps with the head were followed by one without it (295
steps, ``spin bench learned --passes 4`` at 14ac70c), 10% with this estimate (430 steps).

Greedy requests keep the discounted estimate (``acceptance.py``): their steps are not
exchangeable (the same warm-up: 0.55 for two model drafters, whose greedy output loops).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

MIN_REQUESTS = 8
"""Released requests with a record of a drafter before its dispersion is used."""
WINDOW = 128
"""The released requests it is measured on, the most recent."""
MAX_STRENGTH = 1000.0
"""The strength where the requests' rates differ no more than their sampling noise."""


@dataclass
class Dispersion:
    """Per population entry (``population.population_name``): the released requests' accepted
    tokens and rejections, and the prior strength they measure (module doc)."""

    _records: dict[str, deque[tuple[float, float]]] = field(default_factory=dict, repr=False)
    """entry -> (accepted tokens, rejections) of each of the last ``WINDOW`` requests"""
    _strength: dict[str, float] = field(default_factory=dict, repr=False)
    """entry -> its strength, computed when a request is recorded (read on every step)"""

    def record(self, entry: str, accepted: float, rejected: float) -> None:
        """A released request's own evidence of the entry's drafter (at least one rejection and
        one accepted token make a rate worth comparing; fewer trials carry no spread)."""
        if accepted + rejected < 2:
            return
        recs = self._records.setdefault(entry, deque(maxlen=WINDOW))
        recs.append((accepted, rejected))
        if len(recs) >= MIN_REQUESTS:
            self._strength[entry] = _strength(recs)

    def strength(self, entry: str) -> float | None:
        """Trials the population rate is worth in a request's estimate; None before
        ``MIN_REQUESTS`` requests (module doc)."""
        return self._strength.get(entry)


def _strength(recs: deque[tuple[float, float]]) -> float:
    """The method of moments' ``m`` over these requests' counts (module doc)."""
    rates = [s / (s + f) for s, f in recs]
    mean = sum(rates) / len(rates)
    spread = sum((r - mean) ** 2 for r in rates) / len(rates)
    noise = sum(r * (1 - r) / (s + f) for r, (s, f) in zip(rates, recs)) / len(rates)
    between = spread - noise
    if between <= 0:
        return MAX_STRENGTH
    return min(MAX_STRENGTH, max(0.0, mean * (1 - mean) / between - 1))
