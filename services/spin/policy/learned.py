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

A step in which the bandit's drafter did not speculate (the controller chose k = 0 for it, or
prompt lookup found no match) still rewards that drafter, with the one token such a step yields,
so the bandit moves on instead of keeping a drafter that never drafts; and in that step the
request first tries its next-best drafter (by posterior mean) through the controller once more.

**Prompt fit.** At a request's first step prompt lookup drafts, and every model drafter scores
the prompt instead: it prefills it (a prefill it reuses later) and counts the prompt tokens equal
to its greedy prediction from the tokens before them. The router sends these calls during the
verification, which is the target's prefill of the same prompt. That agreement with the user's
text is no acceptance rate, but it ranks the drafters (``prompt_fit.py``, ``spin bench fit``), so
from then on the request's bandit chooses between the best-fitting drafter and prompt lookup
only, and the best-fitting drafter starts from what the drafters that fitted earlier requests
achieved. The first step earns no bandit reward: its time is the target's prefill.

**Scoring.** Once a request has generated ``score_after`` tokens, each candidate it is not using
scores them the same way (prompt lookup in the router). With greedy decoding a draft token is
accepted exactly when it equals the target's token, so agreement on the target's own output *is*
the drafter's acceptance rate on this request. Each scored position counts as one accepted or
rejected draft token in the request's acceptance estimate for the drafter, and the drafter's
bandit prior (own steps kept) becomes the goodput the cost model predicts at the best k for that
rate. Without the prompt fit every drafter scores, so a request learns which drafter fits it from
one round of prefills instead of one slow exploratory step per drafter.

**Calibration.** The cost model is fitted on bare forwards (``spin profile``); in serving a step
also pays round trips and the services' and the router's own work. After each step the router
reports each drafter call's seconds and the rest of the step (``observe_step``), and the
controller moves each part's per-call constant a tenth of its error, so predicted step times (and
the k chosen from them) follow the deployment. Scoring calls run during the verification (the
router sends them after drafting), so a step that scored calibrates its drafters but not its
verification.

A request held at k = 0 for ``probe_every`` steps in a row gets one k = 1 step with its drafter,
so its acceptance estimate can recover (the controller alone would never observe it again).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from .base import PROMPT_LOOKUP, RequestView, StepChoice, StepPrediction
from .cost_model import CostModel
from .goodput import ControllerConfig, SpecLengthController, expected_tokens
from .prompt_fit import PromptFit
from .selector import DraftSelector, SelectorConfig, population_from_stats

log = logging.getLogger(__name__)


@dataclass
class LearnedPolicyConfig:
    """Settings of the learned policy."""

    selector: SelectorConfig = field(default_factory=SelectorConfig)
    """The per-request bandit. Its population prior weighs 3 steps: with the prompt fit a request
    weighs two candidates. When 8 was the default, ``spin bench ab --a '{}' --b '{"selector":
    {"prior_strength": 3.0}}'`` measured B / A = 0.959 with the prompt fit (0.977 before it)."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The speculation-length controller."""
    refresh_s: float = 5.0
    """How often the population statistics are re-read (in a background thread)."""
    probe_every: int = 16
    """Steps at k = 0 after which a request probes once with k = 1."""
    score_after: int = 4
    """Generated tokens after which every unused candidate scores the request's output (see the
    module doc); 0 = never (and no prompt fit)."""
    score_every: int = 0
    """Generated tokens between later scoring rounds (0 = ``score_after``)."""
    score_rounds: int = 1
    """Scoring rounds per request at most (each adds the new tokens to the counts). One was no
    worse than more when every drafter scored and a round held up its step: ``spin bench ab --a
    '{"score_rounds": 4}' --b '{}'`` measured B / A = 0.987 (its noise floor is about 2%)."""
    prompt_fit: bool = True
    """At a request's first step (prompt lookup drafts) every model drafter scores the prompt
    while the target prefills it (the router sends scoring calls during the verification); the
    request's candidates then narrow to the best-fitting drafter and prompt lookup, the former
    seeded from earlier best-fit requests (``prompt_fit.py``)."""
    fit_margin: float = 0.0
    """Model drafters whose prompt agreement is within this of the best's are candidates too.
    ``spin bench ab --a '{}' --b '{"fit_margin": 0.05}'`` measured B / A = 0.998: a structured
    request whose best drafter came second by prompt gained, code requests lost as much to the
    extra exploration."""
    fit_trials: float = 8.0
    """Weight, in draft tokens, of that seed in the request's acceptance estimate."""
    score_trials: float = 4.0
    """Weight, in steps, of the bandit prior predicted from a drafter's agreement (the agreement
    itself adds one accepted or rejected draft token per scored position to the acceptance
    estimate)."""
    fallback: bool = True
    """A request whose drafter gets k = 0 tries its next-best drafter in the same step."""


def _checked(where: str, key: str, old: object, value: object) -> object:
    """``value`` for a setting whose default is ``old`` (an int may stand for a float); else
    ``ValueError``."""
    ok = (type(value) is type(old) or (type(value) is int and type(old) is float)
          or (old is None and isinstance(value, (int, float, str))))
    if not ok:
        raise ValueError(f"{where} setting {key!r} takes {type(old).__name__} values, "
                         f"got {value!r}")
    return value


def learned_config(overrides: dict | None = None, **base) -> LearnedPolicyConfig:
    """A ``LearnedPolicyConfig`` from ``base`` keyword arguments and JSON-like ``overrides``
    (``{"score_rounds": 2, "selector": {"ucb_c": 0.1}, "controller": {"k_max": 6}}``), e.g. from
    the router's ``--policy-config``. ``ValueError`` names an unknown or ill-typed setting."""
    cfg = LearnedPolicyConfig(**base)
    nested = {"selector": SelectorConfig, "controller": ControllerConfig}
    known = sorted(f.name for f in fields(LearnedPolicyConfig))
    for key, value in (overrides or {}).items():
        if key not in known:
            raise ValueError(f"unknown learned-policy setting {key!r}; known: {known}")
        if key in nested:
            if not isinstance(value, dict):
                raise ValueError(f"learned-policy setting {key!r} takes an object, got {value!r}")
            inner = getattr(cfg, key)
            names = sorted(f.name for f in fields(nested[key]))
            unknown = sorted(set(value) - set(names))
            if unknown:
                raise ValueError(f"unknown {key} setting(s) {unknown}; known: {names}")
            value = replace(inner, **{k: _checked(key, k, getattr(inner, k), v)
                                      for k, v in value.items()})
        else:
            value = _checked("learned-policy", key, getattr(cfg, key), value)
        cfg = replace(cfg, **{key: value})
    return cfg


class LearnedPolicy:
    """Implements ``policy.base.Policy``."""

    def __init__(self, cfg: LearnedPolicyConfig | None = None, cost: CostModel | None = None,
                 population: Callable[[], dict] | None = None) -> None:
        self.cfg = cfg or LearnedPolicyConfig()
        self.selector = DraftSelector(self.cfg.selector)
        self.controller = SpecLengthController(cost, self.cfg.controller)
        self._population = population
        self._idle: dict[str, int] = {}
        self._chosen: dict[str, str] = {}
        """request id -> the bandit's drafter this step (auto mode only)"""
        self._scored: dict[str, int] = {}
        """request id -> scoring rounds so far"""
        self._agreement: dict[str, dict[str, list[int]]] = {}
        """request id -> drafter -> [matches, positions] summed over rounds"""
        self._ctx: dict[str, int] = {}
        """request id -> context length at its last step"""
        self.fit = PromptFit(margin=self.cfg.fit_margin)
        """Prompt agreement per request, and how best-fitting drafters did (``prompt_fit.py``)."""
        self._fitted: set[str] = set()
        """Requests whose best-fitting drafter has been seeded."""
        self._prefill: set[str] = set()
        """Requests whose step being verified prefills the target (no bandit reward)."""
        self.last_prediction: StepPrediction | None = None
        """The cost model's account of the step last chosen (None without a cost model or when
        no request is in mode auto); read it right after ``choose``."""
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
        cands = {r.request_id: self._candidates(r, available) for r in requests
                 if r.mode == "auto"}
        drafters: list[str | None] = []
        for r in requests:
            if r.mode == "off":
                drafters.append(None)
            elif r.mode == "drafter":
                drafters.append(r.drafter if r.drafter in available else PROMPT_LOOKUP)
            else:
                drafters.append(self.selector.choose(r.request_id, cands[r.request_id]))
                self._chosen[r.request_id] = drafters[-1]
        batch = [(r.request_id, d, r.context_len) for r, d in zip(requests, drafters)]
        auto = any(r.mode == "auto" for r in requests)
        ks = self.controller.choose(batch) if auto else [0] * len(requests)
        if auto and self.cfg.fallback:
            ks = self._fallback(requests, drafters, batch, ks, cands)
        out = []
        for r, d, k in zip(requests, drafters, ks):
            if r.mode == "drafter" and r.k:
                k = r.k
            elif d is not None and k == 0 and self._idle.get(r.request_id, 0) >= self.cfg.probe_every:
                k = 1
            k = min(k, r.remaining - 1)
            self._idle[r.request_id] = 0 if k > 0 else self._idle.get(r.request_id, 0) + 1
            score: tuple[str, ...] = ()
            rounds = self._scored.get(r.request_id, 0)
            if not self.cfg.score_after or r.mode != "auto":
                pass
            elif r.generated == 0 and self.cfg.prompt_fit and r.remaining > self.cfg.score_after:
                score = tuple(sorted(available - {PROMPT_LOOKUP}))  # the prompt, not a round
            elif (rounds < self.cfg.score_rounds and r.generated >= self.cfg.score_after
                  + rounds * (self.cfg.score_every or self.cfg.score_after)):
                self._scored[r.request_id] = rounds + 1
                score = tuple(sorted(cands[r.request_id]))
            self._ctx[r.request_id] = r.context_len
            if r.generated == 0:
                self._prefill.add(r.request_id)
            out.append(StepChoice(d, k, score=score) if d is not None and k > 0
                       else StepChoice(None, score=score))
        self.last_prediction = None
        if auto and self.controller.cost is not None:
            drafts, verify = self.controller.predicted_parts(batch, [c.k for c in out])
            self.last_prediction = StepPrediction(
                self.controller.step_s(drafts, verify), drafts, verify,
                frozenset(n for c in out for n in c.score))
        return out

    def _candidates(self, r: RequestView, available: set[str]) -> set[str]:
        """The drafters the request's bandit chooses from: prompt lookup while the model drafters
        score the prompt, then the best-fitting one and prompt lookup (``prompt_fit.py``)."""
        if not (self.cfg.prompt_fit and self.cfg.score_after):
            return available
        if r.generated == 0 and PROMPT_LOOKUP in available:
            return {PROMPT_LOOKUP}
        fitting = [d for d in self.fit.fitting(r.request_id) if d in available]
        if not fitting:
            return available
        if r.request_id not in self._fitted:  # seed them from the earlier requests they fitted
            self._fitted.add(r.request_id)
            for d in fitting:
                rate = self.fit.acceptance(d)
                if rate is not None:
                    w = self.cfg.fit_trials
                    self.controller.tracker.add_evidence(r.request_id, d, rate * w, (1 - rate) * w)
                    self._prior_from_rate(r.request_id, d, rate, r.context_len)
        return set(fitting) | (available & {PROMPT_LOOKUP})

    def _fallback(self, requests: list[RequestView], drafters: list[str | None],
                  batch: list[tuple[str, str | None, int]], ks: list[int],
                  cands: dict[str, set[str]]) -> list[int]:
        """Requests whose bandit drafter got k = 0 try their next-best drafter (by posterior mean)
        once more through the controller; a drafter that would not draft is no use this step."""
        swapped = list(drafters)
        for i, r in enumerate(requests):
            if (r.mode != "auto" or ks[i] > 0 or drafters[i] is None
                    or (self.cfg.score_after and r.request_id not in self._scored
                        and r.request_id not in self._fitted)):
                continue  # before its prompt fit or scores a request's next-best is a guess
            ranked = sorted(((mean, name) for name, (mean, _) in
                             self.selector.snapshot(r.request_id).items()
                             if name in cands[r.request_id] and name != drafters[i]),
                            reverse=True)
            if ranked:
                swapped[i] = ranked[0][1]
        if swapped == drafters:
            return ks
        alt = self.controller.choose([(rid, d, c) for (rid, _, c), d in zip(batch, swapped)])
        out = list(ks)
        for i, r in enumerate(requests):
            if swapped[i] != drafters[i] and alt[i] > 0:
                drafters[i], out[i] = swapped[i], alt[i]
                self._chosen[r.request_id] = swapped[i]
                batch[i] = (r.request_id, swapped[i], batch[i][2])
        return out

    def observe(self, request_id: str, choice: StepChoice, accepted: int, draft_s: float,
                verify_s: float) -> None:
        chosen = self._chosen.pop(request_id, None)
        if request_id in self._prefill:  # the target's prefill makes it no drafter's measure
            self._prefill.discard(request_id)
            if choice.drafter is not None:
                self.controller.observe(request_id, choice.drafter, choice.k, accepted)
            return
        if choice.drafter is None:
            if chosen is not None:  # the bandit's pick gave a plain step: one token
                self.selector.update(request_id, chosen, 1, draft_s + verify_s)
            return
        seconds = draft_s + verify_s + self.selector.switch_cost_s(request_id, choice.drafter)
        self.selector.update(request_id, choice.drafter, accepted + 1, seconds)
        self.controller.observe(request_id, choice.drafter, choice.k, accepted)
        self.fit.record(request_id, choice.drafter, accepted, float(accepted < choice.k))

    def observe_score(self, request_id: str, drafter: str, matches: int, positions: int) -> None:
        """Seed the request's acceptance estimate and bandit prior of ``drafter`` from its
        agreement with the request's own output (module doc); before there is output, the score
        is of the prompt (``prompt_fit.py``)."""
        if positions <= 0:
            return
        if request_id not in self._scored:
            self.fit.observe_prompt(request_id, drafter, matches, positions)
            return
        self.fit.record(request_id, drafter, matches, positions - matches)
        self.controller.tracker.add_evidence(request_id, drafter, matches, positions - matches)
        total = self._agreement.setdefault(request_id, {}).setdefault(drafter, [0, 0])
        total[0] += matches
        total[1] += positions
        self._prior_from_rate(request_id, drafter, (total[0] + 0.5) / (total[1] + 1.0),
                              self._ctx.get(request_id, 0))

    def _prior_from_rate(self, request_id: str, drafter: str, rate: float, ctx: int) -> None:
        """The request's bandit prior of ``drafter``: the goodput the cost model predicts at the
        best k for acceptance ``rate``, worth ``score_trials`` steps."""
        best = 0.0
        for k in range(1, self.controller.cfg.k_max + 1):
            step_s = self.controller.predicted_step_s([(request_id, drafter, ctx)], [k])
            if not step_s > 0.0:  # no cost model: rescale the population prior instead
                pop = self.controller.tracker.prior(drafter)
                self.selector.scale_prior(request_id, drafter,
                                          expected_tokens(rate, 4) / expected_tokens(pop, 4))
                return
            best = max(best, expected_tokens(rate, k) / step_s)
        self.selector.set_prior(request_id, drafter, best, self.cfg.score_trials)

    def observe_step(self, prediction: StepPrediction, draft_s: dict[str, float],
                     verify_s: float) -> None:
        """Calibrate the cost model on the served step (``SpecLengthController.calibrate``); the
        verification is left out when drafters scored requests meanwhile (it shared the machine
        with work the model does not count)."""
        self.controller.calibrate(prediction.draft_s,
                                  math.nan if prediction.scoring else prediction.verify_s,
                                  draft_s, verify_s)

    def release(self, request_id: str) -> None:
        self._scored.pop(request_id, None)
        self._agreement.pop(request_id, None)
        self._fitted.discard(request_id)
        self._prefill.discard(request_id)
        self.fit.release(request_id)
        self._ctx.pop(request_id, None)
        self.selector.release(request_id)
        self.controller.release(request_id)
        self._idle.pop(request_id, None)
        self._chosen.pop(request_id, None)
