"""The learned policy: SPIN's per-request draft selection + SmartSpec's goodput-chosen k.

Per step, for the running batch:
1. each request in mode auto gets a drafter from its bandit (``selector.py``), warm-started from
   the population statistics (Redis), refreshed in the background every ``refresh_s``;
2. the speculation-length controller (``goodput.py``) picks every request's k in 0..k_max to
   maximise the batch's predicted goodput under the fitted cost model, and k = 0 for all unless
   speculation wins by the margin (SmartSpec's 10%), so speculation never makes a step worse by the
   model's account;
3. after verification, the step's goodput (tokens over the step's draft + verify wall time, round
   trips included, plus the switching cost when the drafter changed) rewards the bandit, and the
   accepted count updates the request's acceptance estimate.

A request held at k = 0 for ``probe_every`` steps in a row gets one k = 1 step with its drafter, so
its acceptance estimate can recover (the controller alone would never observe it again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import PROMPT_LOOKUP, RequestView, StepChoice
from .cost_model import CostModel
from .goodput import ControllerConfig, SpecLengthController
from .selector import DraftSelector, SelectorConfig, population_from_stats

log = logging.getLogger(__name__)


@dataclass
class LearnedPolicyConfig:
    """Settings of the learned policy."""

    selector: SelectorConfig = field(default_factory=lambda: SelectorConfig(prior_strength=8.0))
    """The per-request bandit. The population prior weighs 8 steps: requests here are short
    (tens of steps) and a drafter tried against a confident prior costs a whole slow step."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The speculation-length controller."""
    refresh_s: float = 5.0
    """How often the population statistics are re-read (in a background thread)."""
    probe_every: int = 16
    """Steps at k = 0 after which a request probes once with k = 1."""


class LearnedPolicy:
    """Implements ``policy.base.Policy``."""

    def __init__(self, cfg: LearnedPolicyConfig | None = None, cost: CostModel | None = None,
                 population: Callable[[], dict] | None = None) -> None:
        self.cfg = cfg or LearnedPolicyConfig()
        self.selector = DraftSelector(self.cfg.selector)
        self.controller = SpecLengthController(cost, self.cfg.controller)
        self._population = population
        self._idle: dict[str, int] = {}
        self.last_predicted_step_s: float | None = None
        """Predicted time of the step last chosen (None without a cost model)."""
        self._stop = threading.Event()
        if population is not None:
            self.refresh()
            threading.Thread(target=self._refresh_loop, daemon=True,
                             name="policy-population").start()

    def refresh(self) -> None:
        """Re-read the population statistics into the bandit priors and acceptance seeds."""
        try:
            stats = self._population()
        except Exception as e:  # the store never raises by contract; stay safe regardless
            log.warning("population statistics unavailable: %s", e)
            return
        self.selector.set_population(population_from_stats(stats))
        self.controller.tracker.set_population(
            {name: s.acceptance_rate for name, s in stats.items() if s.draft_tokens})

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.cfg.refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()

    def choose(self, requests: list[RequestView], available: set[str]) -> list[StepChoice]:
        drafters: list[str | None] = []
        for r in requests:
            if r.mode == "off":
                drafters.append(None)
            elif r.mode == "drafter":
                drafters.append(r.drafter if r.drafter in available else PROMPT_LOOKUP)
            else:
                drafters.append(self.selector.choose(r.request_id, available))
        batch = [(r.request_id, d, r.context_len) for r, d in zip(requests, drafters)]
        auto = any(r.mode == "auto" for r in requests)
        ks = self.controller.choose(batch) if auto else [0] * len(requests)
        out = []
        for r, d, k in zip(requests, drafters, ks):
            if r.mode == "drafter" and r.k:
                k = r.k
            elif d is not None and k == 0 and self._idle.get(r.request_id, 0) >= self.cfg.probe_every:
                k = 1
            k = min(k, r.remaining - 1)
            self._idle[r.request_id] = 0 if k > 0 else self._idle.get(r.request_id, 0) + 1
            out.append(StepChoice(d, k) if d is not None and k > 0 else StepChoice(None))
        self.last_predicted_step_s = None
        if auto and self.controller.cost is not None:
            self.last_predicted_step_s = self.controller.predicted_step_s(
                batch, [c.k for c in out])
        return out

    def observe(self, request_id: str, choice: StepChoice, accepted: int, draft_s: float,
                verify_s: float) -> None:
        if choice.drafter is None:
            return
        seconds = draft_s + verify_s + self.selector.switch_cost_s(request_id, choice.drafter)
        self.selector.update(request_id, choice.drafter, accepted + 1, seconds)
        self.controller.observe(request_id, choice.drafter, choice.k, accepted)

    def release(self, request_id: str) -> None:
        self.selector.release(request_id)
        self.controller.release(request_id)
        self._idle.pop(request_id, None)
