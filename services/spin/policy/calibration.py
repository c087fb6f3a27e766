"""Online calibration of the cost model: what a served step costs, against what it predicted.

The cost model (``timing/cost_model.py``) is fitted on the services' bare forwards at start. In
serving a step also pays round trips and the services' own work, and on a machine whose cores
the verifier, the drafters and the router share, speculation's *marginal* cost grows most: the
drafters' calls run at once on the same cores, and the verifier scores ``B * (k + 1)`` tokens
beside them. A router's step trace (``spin bench trace``) of ``spin bench grid --split tuning
--temperatures 0.8`` on this project's 2-core CPU: at batch 4-63 the model predicted a
speculating step's drafter calls at 0.09-0.20 of their measured seconds and its verification at
0.76-0.89, while plain steps' verifications came within 10%; the controller expected
speculation to gain 1.05-1.4x where it measured 0.46-0.70x.
A correction of the per-call constants alone (this module's predecessor) cannot fit both: it
moved the constants up on speculating steps and down on plain ones, and predicted neither.

So the correction is multiplicative, per part, and learnt from the steps that show that part:

- ``plain``: measured / predicted seconds of the verification at k = 0 (every plain step);
- ``marginal``: what speculating adds to the verification (measured minus the calibrated plain
  prediction) over what the model predicts it adds, from steps that speculated;
- ``drafter[name]``: measured / predicted seconds of that drafter's call, from steps it drafted.

Each moves ``rate`` of the way toward its step's ratio (an exponential average over about
``1 / rate`` of the steps that show it), from 1 (the fitted model). A speculating part
(``marginal``, a drafter's) not shown for more than ``1 / rate`` steps drifts slowly back toward
1 (``FORGET_SHARE``: half-way in about 70 more steps at rate 0.1): evidence ages, and a factor inflated by a few slow
steps (a service's first calls after start, a burst of contention) must not price speculation
out for good, since only steps that speculate can correct it. The first version kept the value
between such steps and locked speculation out: on ``spin bench grid --split tuning
--temperatures 0``, greedy single streams fell to 0.91-1.05x off, from 1.59-1.69x before.
Ratios are clipped to [1/8, 8] per step and the factors to [1/16, 16] (a step stalled by a
garbage collection or a noisy neighbour moves a factor by at most ``rate`` of 8x). Steps in
which a request prefills, or drafters score beside the verification, do not calibrate the
verification (their time is the prompts' and the scoring calls'; ``scoring_cost.py`` fits the
latter).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

RATIO_CLIP = 8.0
"""One step's measured / predicted ratio is clipped to [1 / RATIO_CLIP, RATIO_CLIP]."""
FACTOR_CLIP = 16.0
"""A factor stays in [1 / FACTOR_CLIP, FACTOR_CLIP]."""
FORGET_SHARE = 0.1
"""A speculating part not shown for more than ``1 / rate`` steps moves ``rate * FORGET_SHARE``
of the way back to 1 (in log terms) at each further step: with rate 0.1, half-way in about 70
steps."""


def _clip(x: float, bound: float) -> float:
    return min(max(x, 1.0 / bound), bound)


@dataclass
class Calibration:
    """Multiplicative corrections of the cost model's parts, learnt in serving (module doc)."""

    rate: float = 0.1
    """Weight of each step's ratio in its factor; 0 = no calibration (all factors stay 1)."""
    plain: float = 1.0
    """Verification at k = 0: measured / predicted."""
    marginal: float = 1.0
    """What speculating adds to the verification: measured / predicted."""
    drafter: dict[str, float] = field(default_factory=dict)
    """Per model drafter: its call's measured / predicted seconds (1 when not yet seen)."""
    _idle: dict[str, int] = field(default_factory=dict, repr=False)
    """Steps since each speculating part ("marginal", a drafter's name) was last shown."""

    def draft(self, name: str) -> float:
        return self.drafter.get(name, 1.0)

    def verify(self, plain_s: float, full_s: float) -> float:
        """Calibrated verification seconds from the model's own prediction of the batch at
        k = 0 (``plain_s``) and as chosen (``full_s``); works on arrays too."""
        return self.plain * plain_s + self.marginal * (full_s - plain_s)

    def _move(self, factor: float, ratio: float) -> float:
        if not math.isfinite(ratio) or ratio <= 0:
            return factor
        moved = factor * (1.0 + self.rate * (_clip(ratio, RATIO_CLIP) - 1.0))
        return _clip(moved, FACTOR_CLIP)

    def observe(self, plain_s: float, verify_s: float, measured_verify_s: float,
                draft_s: Mapping[str, float], measured_draft_s: Mapping[str, float],
                verification: bool = True) -> None:
        """One served step: its calibrated predictions (the verification at k = 0, as chosen,
        each drafter's call) and what was measured (a drafter measured 0 or not at all did not
        answer). ``verification`` False: the step's verification does not calibrate (a prefill
        or scoring calls ran in it)."""
        if not self.rate:
            return
        shown = set()
        for name, pred in draft_s.items():
            got = measured_draft_s.get(name, 0.0)
            if pred > 0 and got > 0:
                self.drafter[name] = self._move(self.draft(name), got / pred)
                shown.add(name)
        added = verify_s - plain_s
        if verification and measured_verify_s > 0 and plain_s > 0:
            if added <= 1e-9 * plain_s:  # a plain step: the plain part alone
                self.plain = self._move(self.plain, measured_verify_s / plain_s)
            else:  # speculation's part: what was measured beyond the plain prediction
                self.marginal = self._move(self.marginal, (measured_verify_s - plain_s) / added)
                shown.add("marginal")
        for part in ("marginal", *self.drafter):
            self._idle[part] = 0 if part in shown else self._idle.get(part, 0) + 1
            if self._idle[part] > 1.0 / self.rate:
                if part == "marginal":
                    self.marginal = self._forget(self.marginal)
                else:
                    self.drafter[part] = self._forget(self.drafter[part])

    def factors(self) -> dict[tuple[str, str], float]:
        """(part, model drafter) -> measured / predicted seconds: "verify_plain" and
        "verify_speculating" (drafter ""), "draft" per drafter seen; for metrics."""
        out = {("verify_plain", ""): self.plain, ("verify_speculating", ""): self.marginal}
        out.update({("draft", name): f for name, f in sorted(self.drafter.items())})
        return out

    def _forget(self, factor: float) -> float:
        return factor ** (1.0 - self.rate * FORGET_SHARE)

    def reset(self) -> None:
        """Back to the fitted model (a new cost model)."""
        self.plain = self.marginal = 1.0
        self.drafter = {}
        self._idle = {}
