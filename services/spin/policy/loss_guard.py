"""Speculation never slower than off, by measurement: the policy's plan against plain steps.

The controller (``goodput.py``) predicts each step's goodput from a cost model and acceptance
estimates. Both can be wrong where it matters most: under load on a busy machine, the verifier's
forward over ``B * (k + 1)`` tokens costs more than the start-up measurements say, and a sampling
request's drafts are accepted less than its scores suggest. So the learned policy also *measures*
what speculation delivers. For each kind of step (``StepKind``: the micro-batch's size, rounded
to a power of two, and whether its requests are greedy, sampled or mixed) the guard keeps the
rates, tokens per second of step (the throughput that a mean latency is the inverse of), of the
last ``window`` steps that speculated and of the last that did not, and compares their medians.
A median, not a mean: one step in which a burst of requests prefilled their prompts takes many
times a decoding step, and would sway a mean for as long as the side it fell on is not run.

While speculation measures at least the rate of plain steps, the policy's plan runs; once it
measures less, that kind of step runs without speculation (k = 0 for every request in mode auto).
The side not in use is probed with one step now and then, so a decision follows the traffic:
first after ``probe_min`` steps, then at twice the interval after each probe that confirmed the
decision, up to ``probe_max`` (a confirmed decision costs at most one step in ``probe_max``), and
from ``probe_min`` again after a probe that reversed it. Until both sides have ``min_steps``
steps, the first decision holds (speculate, unless a smaller batch of the same decoding
measured a loss) and the other side is probed at ``probe_min``. Steps in which a request
prefills its prompt count too: requests arrive whatever the plan, so both sides get their share
of them, and what speculation costs there (the drafters prefilling the prompt to score it, on the
same machine as the verification) is part of what it costs.

No threshold is set by hand: the rule compares two measured rates. The probing constants bound
what a decision costs and how fast it follows a change (``GuardConfig``).
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import Literal

Decoding = Literal["greedy", "sampled", "mixed"]
StepKind = tuple[int, Decoding]
"""(batch-size bucket: bit length of the batch size, decoding of its requests)."""


@dataclass(frozen=True)
class GuardConfig:
    """How the guard measures and probes."""

    enabled: bool = True
    """Off: the policy's plan always runs (the controller's prediction alone decides)."""
    window: int = 16
    """Steps of each side (per kind of step) whose median rate is compared."""
    min_steps: int = 4
    """Steps each side needs before the comparison decides."""
    probe_min: int = 2
    """Steps between probes of the side not in use, after a reversal (and at the start)."""
    probe_max: int = 64
    """Longest interval between probes (one step in this many pays for watching)."""

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_steps <= self.window:
            raise ValueError(f"guard needs 1 <= min_steps <= window, got {self}")
        if not 1 <= self.probe_min <= self.probe_max:
            raise ValueError(f"guard probes need 1 <= probe_min <= probe_max, got {self}")


class _Side:
    """The rates of one side's last steps."""

    def __init__(self, window: int) -> None:
        self.rates: collections.deque[float] = collections.deque(maxlen=window)
        self.steps = 0

    def add(self, tokens: int, seconds: float) -> None:
        self.rates.append(tokens / seconds)
        self.steps += 1

    @property
    def rate(self) -> float:
        return statistics.median(self.rates) if self.rates else 0.0


@dataclass
class _Kind:
    """What the guard knows of one kind of step."""

    spec: _Side
    off: _Side
    speculate: bool = True
    """The decision: run the plan (True) or plain steps."""
    interval: int = 0
    """Steps between probes now."""
    since_probe: int = 0
    """Steps since the last probe."""


def step_kind(greedy: list[bool]) -> StepKind:
    """The kind of a micro-batch of requests with these decodings."""
    decoding: Decoding = ("greedy" if all(greedy) else "sampled" if not any(greedy)
                          else "mixed")
    return len(greedy).bit_length(), decoding


class LossGuard:
    """Per kind of step: speculate, or run plain steps (module doc)."""

    def __init__(self, cfg: GuardConfig | None = None) -> None:
        self.cfg = cfg or GuardConfig()
        self._kinds: dict[StepKind, _Kind] = {}

    def _kind(self, kind: StepKind) -> _Kind:
        k = self._kinds.get(kind)
        if k is None:
            w = self.cfg.window
            k = self._kinds[kind] = _Kind(_Side(w), _Side(w), self._prior(kind),
                                          interval=self.cfg.probe_min)
        return k

    def _prior(self, kind: StepKind) -> bool:
        """A new kind's first decision: plain steps if a smaller batch of the same decoding
        already measured speculation at a loss (a step's tokens cost more as the batch grows),
        else speculate."""
        bucket, decoding = kind
        return not any(b < bucket and d == decoding and not k.speculate
                       and min(k.spec.steps, k.off.steps) >= self.cfg.min_steps
                       for (b, d), k in self._kinds.items())

    def speculate(self, kind: StepKind) -> bool:
        """Whether the coming step of this kind runs the policy's plan (else plain steps): the
        decision, or the other side when a probe is due."""
        if not self.cfg.enabled:
            return True
        k = self._kind(kind)
        k.since_probe += 1
        if k.since_probe < k.interval:
            return k.speculate
        k.since_probe = 0
        return not k.speculate

    def observe(self, kind: StepKind, speculated: bool, tokens: int, seconds: float) -> None:
        """A step of this kind ran, speculating or not, and gave ``tokens`` in ``seconds``."""
        if not self.cfg.enabled or seconds <= 0:
            return
        k = self._kind(kind)
        (k.spec if speculated else k.off).add(tokens, seconds)
        if min(k.spec.steps, k.off.steps) < self.cfg.min_steps:
            return
        wins = k.spec.rate >= k.off.rate
        if speculated != k.speculate:  # a probe: did it confirm the decision?
            if wins == k.speculate:
                k.interval = min(2 * k.interval, self.cfg.probe_max)
            else:
                k.interval = self.cfg.probe_min
        k.speculate = wins

    def rates(self) -> dict[StepKind, tuple[float, float, bool]]:
        """Per kind of step: (tokens/s speculating, tokens/s plain, the decision), for metrics
        and reports."""
        return {kind: (k.spec.rate, k.off.rate, k.speculate)
                for kind, k in sorted(self._kinds.items())}
