"""The learned policy: SPIN's per-request draft selection + SmartSpec's goodput-chosen k.

Per step, for the running batch:
1. each request in mode auto gets a drafter from its bandit (``selector.py``), warm-started from
   the population statistics (Redis), refreshed in the background every ``refresh_s``;
2. the speculation-length controller (``goodput.py``) picks every request's k in 0..k_max to
   maximise the batch's predicted goodput under the fitted cost model, k = 0 for all unless
   speculation wins by the margin (SmartSpec's 10%);
3. after verification (one ``outcome.StepOutcome`` per step, ``observe``), the step's goodput
   (tokens over its draft + verify wall time, round trips and a drafter switch's cost included)
   rewards the bandit, and the accepted count updates the request's acceptance estimate.

A step in which the bandit's drafter did not speculate (k = 0) rewards it with the one token
such a step yields; such a request first tries its next-best drafter through the controller
once more. A model-free drafter is no candidate where it finds no match (``base.unmatched``).

**Prompt fit.** At a request's first step the model-free drafters (prompt lookup, suffix decoding:
``engine/model_free.py``) draft, or a head asks, and every model drafter scores the prompt during
the target's prefill of it: the agreement ranks the drafters (``prompt_fit.py``), so from then on
the request's bandit chooses between the best-fitting drafter, seeded from what it achieved on
earlier requests it fitted, the heads and the model-free ones. Every prior is on the scale of the
population's measured goodput (``_prior_from_rate``). The first step earns no bandit reward.

**Measured, not only predicted.** Per kind of step the guard runs plain steps where speculating
ones measure fewer tokens a second, held over several forwards a call (``loss_guard.py``).

**Scoring.** Once a request has generated ``score_after`` tokens, each candidate it is not using
scores them, seeding its acceptance estimate and bandit prior (``scoring_rounds.py``).

**Calibration.** Each part's predicted time (bare forwards) is corrected by a factor learnt on
the served steps that show it: round trips, the services' work, contention (``calibration.py``).
A step whose scoring calls ran beside the verification, or that prefilled a prompt, calibrates
its drafters only; what scoring calls add to a step is fitted apart (``scoring_cost.py``).

**Chains.** A model drafter's chain stops once its probability falls below ``stop_below``, so k is
the longest chain the step may draft (``chain_length.py``). Held at k = 0 by the controller (not
the guard), a request probes with k = 1 after ``probe_every`` such steps. A head's chain drafted
for it is verified, at k = 0 where that pays, whichever drafter the bandit picks next; a turn to
a head is priced over its two steps (``head_chains.py``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from ..timing.cost_model import CostModel
from .base import (MODEL_FREE, PROMPT_LOOKUP, RequestView, StepChoice, StepPlan,
                   StepPrediction, unmatched)
from .chain_length import ChainLength
from .goodput import SpecLengthController, expected_tokens
from .head_chains import HeadChains
from .learned_config import LearnedPolicyConfig, learned_config
from .loss_guard import LossGuard, StepKind, step_kind
from .outcome import RequestOutcome, Score, StepOutcome
from .population import PopulationFeed, StepStats, population_from_stats
from .prompt_fit import PromptFit
from .request_state import RequestState
from .scoring_cost import ScoringCost
from .scoring_rounds import ScoringRounds
from .selector import DraftSelector
from .tree_choice import RunnerUps, choose_shapes, tree_candidates
from .tree_shape import Shape, nodes

__all__ = ["LearnedPolicy", "LearnedPolicyConfig", "learned_config"]

Batch = list[tuple[str, str | None, int]]  # (request id, drafter, context length): priced


class LearnedPolicy:
    """``policy.base.Policy`` (module doc); ``choose`` runs in phases: drafters, k, scorers."""

    def __init__(self, cfg: LearnedPolicyConfig | None = None, cost: CostModel | None = None,
                 population: Callable[[], dict] | None = None) -> None:
        self.cfg = cfg or LearnedPolicyConfig()
        self.selector = DraftSelector(self.cfg.selector)
        self.controller = SpecLengthController(cost, self.cfg.controller)
        self._requests: dict[str, RequestState] = {}  # (``request_state.py``)
        c = self.cfg
        self.fit = PromptFit(margin=c.fit_margin, rank_margin=c.fit_rank_margin,
                             deficit_weight=c.fit_deficit_weight, value=self._fit_value,
                             prune_after=c.fit_prune_after, explore_every=c.fit_explore_every)
        """Prompt agreement per request, and how best-fitting drafters did (``prompt_fit.py``)."""
        self.scoring_cost = ScoringCost()
        """What scoring calls add to a step (``scoring_cost.py``), in the plan's prediction."""
        self.chains = ChainLength()
        """How much of k early-stopping chains draft (``chain_length.py``)."""
        self.scoring = ScoringRounds(self.cfg, self.fit)
        """Who scores a request when, and what it feeds (``scoring_rounds.py``)."""
        self.runner_ups = RunnerUps(self.cfg.runner_up_prior, ema=self.cfg.controller.ema)
        """How often each drafter's second choice is the target's token (``tree_choice.py``)."""
        self.guard = LossGuard(self.cfg.guard)
        """Speculation measured against plain steps (``loss_guard.py``)."""
        self.population = (PopulationFeed(population, self._set_population, self.cfg.refresh_s)
                           if population is not None else None)
        """The population statistics, re-read in the background (``population.py``)."""
        self.heads: frozenset[str] = frozenset()
        """The drafters that draft inside the verifier, as the last ``choose`` had them."""
        self.head_chains = HeadChains()
        """Heads' chains drafted for a request's coming step, verified at k = 0 too."""

    def _set_population(self, stats: Mapping[str, StepStats]) -> None:
        """New population statistics: the bandit priors and acceptance seeds."""
        self.selector.set_population(population_from_stats(stats))
        self.controller.tracker.set_population(
            {name: s.chain_acceptance for name, s in stats.items() if s.draft_tokens})

    def close(self) -> None:
        if self.population is not None:
            self.population.close()

    def _begin(self, r: RequestView) -> RequestState:
        """A request's state in a step, it and its bandit and estimates made at first sight."""
        if r.request_id not in self._requests:
            self.selector.begin(r.request_id, r.greedy)
            self.controller.tracker.begin(r.request_id, r.greedy)
            self.fit.begin(r.request_id, r.greedy)
        return self._requests.setdefault(r.request_id, RequestState())

    # ---- choose: drafters, then k, then scoring, then the prediction ---------------------------
    def choose(self, requests: list[RequestView], available: set[str],
               heads: frozenset[str] = frozenset()) -> StepPlan:
        self.heads = heads  # every request's bandit may try them (``_candidates``)
        states = [self._begin(r) for r in requests]
        plain = self.guard.plain(requests)  # the loss guard's plain requests: mode off now
        requests = [replace(r, mode="off") if p else r for r, p in zip(requests, plain)]
        kind = step_kind([r.greedy for r in requests])
        saving = self.guard.saving(kind)  # prices catch-ups (scoring calls: ``pay``)
        cands, drafters = self._drafters(requests, states, available, saving)
        batch = [(r.request_id, d, r.context_len) for r, d in zip(requests, drafters)]
        # k is the controller's for requests in mode auto and for a named drafter without its k
        policy_k = [r.mode == "auto" or (r.mode == "drafter" and not r.k) for r in requests]
        # a first step prefills the prompt (less its likely cached prefix), not k + 1 tokens
        prefill = sum(max(0, r.context_len - 1 - r.cached) for r in requests if not r.generated)
        ks = self._ks(requests, states, drafters, batch, cands, policy_k, prefill)
        shapes = self._shapes(requests, drafters, ks, batch, policy_k, prefill)
        asks = self.head_chains.verify_held(requests, drafters, ks, available, self.controller,
                                            prefill)  # 0: verify a held chain, draft none
        batch = [(b[0], None, b[2]) if a == 0 else b for a, b in zip(asks, batch)]  # priced so
        pay = self.scoring.saving(self.guard, self.controller, kind, batch, ks, prefill)
        out = []
        for r, s, d, k, shape, chosen_k, ask in zip(requests, states, drafters, ks, shapes,
                                                    policy_k, asks):
            score = (() if self.guard.probing else  # a probe measures speculation alone
                     self.scoring.scorers(r, s, d, cands.get(r.request_id, set()) - heads,
                                          available - heads))
            score = self.scoring.priced(r, s, d, score, pay, self.scoring_cost)
            s.ctx, s.prefill = r.context_len, s.prefill or r.generated == 0
            stop = (self.cfg.stop_below if (chosen_k or r.early_stop) and d not in MODEL_FREE
                    and not shape else 0.0)
            out.append(StepChoice(d, k, shape, score=score, stop_below=stop, ask=ask)
                       if d is not None and k > 0 else StepChoice(None, score=score))
        self.head_chains.planned(requests, out, heads)
        if all(c.drafter is None for c in out):  # a plain step: held (``LossGuard.hold``)
            self.guard.drafts_nothing(all(r.generated and not c.score
                                          for r, c in zip(requests, out)))
        predicted = [k or p for k, p in zip(policy_k, plain)]  # a guard's k = 0 is predicted
        return StepPlan(out, self._prediction(requests, states, out, batch, predicted, prefill),
                        self.guard.hold)

    def _drafters(self, requests: list[RequestView], states: list[RequestState],
                  available: set[str], saving: float | None
                  ) -> tuple[dict[str, set[str]], list[str | None]]:
        """Each request's candidates (mode auto, less the drafters whose catch-up it cannot
        afford at ``saving``) and drafter: its own in mode drafter (prompt lookup when that is
        down), its bandit's pick in mode auto, None in mode off or without candidates."""
        cands: dict[str, set[str]] = {}
        drafters: list[str | None] = []
        for r, s in zip(requests, states):
            if r.mode == "off":
                drafters.append(None)
            elif r.mode == "drafter":
                drafters.append(r.drafter if r.drafter in available else PROMPT_LOOKUP)
            else:
                c = self._candidates(r, s, available) - unmatched(r)
                c = cands[r.request_id] = c - self.scoring.unaffordable(
                    r, s, c, self.heads, saving, self.scoring_cost)
                drafters.append(self.selector.choose(r.request_id, c) if c else None)
                s.chosen = drafters[-1] if c else s.chosen
        self.head_chains.keep(requests, drafters, available)  # a chain held is verified
        return cands, drafters

    def _candidates(self, r: RequestView, state: RequestState, available: set[str]) -> set[str]:
        """The drafters the request's bandit chooses from: the model-free ones while the model
        drafters score the prompt, then the best-fitting one, those and the heads; a fitting
        one is seeded from the earlier requests it fitted (``prompt_fit.py``,
        ``_prior_from_rate``), the others keep the population's measure."""
        if not (self.cfg.prompt_fit and self.cfg.score_after):
            return available
        if r.generated == 0 and available & MODEL_FREE:  # (a head asked now drafts the next)
            return available & (MODEL_FREE | self.heads)
        fitting = [d for d in self.fit.fitting(r.request_id) if d in available]
        if not fitting:
            return available
        if not state.fitted:  # seed them from the earlier requests they fitted
            state.fitted = True
            for d in fitting:
                rate = self.fit.acceptance(d, r.request_id)
                if rate is None and self.cfg.fit_pooled_seed:
                    rate = self.fit.pooled_acceptance(r.request_id)
                if rate is not None:
                    w = self.cfg.fit_trials
                    self.controller.tracker.add_evidence(r.request_id, d, rate * w, (1 - rate) * w)
                    self._prior_from_rate(r.request_id, d, rate, r.context_len)
        return set(fitting) | (available & (MODEL_FREE | self.heads))

    def _ks(self, requests: list[RequestView], states: list[RequestState],
            drafters: list[str | None], batch: Batch, cands: dict[str, set[str]],
            policy_k: list[bool], prefill: int) -> list[int]:
        """Each request's k: the controller's (after the fallback, which may change a request's
        drafter: ``drafters`` and ``batch`` in place), a named drafter's own k, or a probe with
        k = 1 after ``probe_every`` steps at k = 0; at most the tokens it has left but one; a
        turn to a head priced over its two steps (``HeadChains.transitions``)."""
        ks = self.controller.choose(batch, prefill) if any(policy_k) else [0] * len(requests)
        turns = self.head_chains.transitions
        turns(requests, drafters, ks, self.heads, self.controller, prefill)
        if self.cfg.fallback and any(r.mode == "auto" for r in requests):
            ks = self._fallback(requests, states, drafters, batch, ks, cands, prefill)
        out = []
        for r, s, d, k in zip(requests, states, drafters, ks):
            if r.mode == "drafter" and r.k:
                k = r.k
            elif d is not None and not k and s.idle >= self.cfg.probe_every:
                k = 1
            k = min(k, r.remaining - 1)
            s.idle = 0 if k > 0 else s.idle + (d is not None)  # guard-plain: not counted
            out.append(k)
        turns(requests, drafters, out, self.heads, self.controller, prefill)
        return out

    def _fallback(self, requests: list[RequestView], states: list[RequestState],
                  drafters: list[str | None], batch: Batch, ks: list[int],
                  cands: dict[str, set[str]], prefill: int) -> list[int]:
        """Requests whose bandit drafter got k = 0 try their next-best one (posterior mean)
        through the controller, once their prompt fit or scores make it no guess."""
        swapped = list(drafters)
        for i, (r, s) in enumerate(zip(requests, states)):
            known = s.scored or s.fitted or not self.cfg.score_after
            if (r.mode == "auto" and ks[i] == 0 and drafters[i] is not None and known
                    and self.head_chains.holding(r.request_id) is None):  # (chain verified)
                swapped[i] = (self.selector.next_best(r.request_id, drafters[i],
                                                      cands[r.request_id]) or drafters[i])
        if swapped == drafters:
            return ks
        alt = self.controller.choose([(rid, d, c) for (rid, _, c), d in zip(batch, swapped)],
                                     prefill)
        out = list(ks)
        for i, (r, s) in enumerate(zip(requests, states)):
            if swapped[i] != drafters[i] and alt[i] > 0:
                drafters[i], out[i], s.chosen = swapped[i], alt[i], swapped[i]
                batch[i] = (r.request_id, swapped[i], batch[i][2])
        return out

    def _shapes(self, requests: list[RequestView], drafters: list[str | None], ks: list[int],
                batch: Batch, policy_k: list[bool], prefill: int) -> list[Shape]:
        """Each request's tree shape (``tree_choice.py``); all chains unless ``cfg.trees``."""
        if not self.cfg.trees:
            return [()] * len(requests)
        cands = tree_candidates(requests, drafters, ks, policy_k, self.controller.tracker,
                                self.runner_ups, self.cfg.tree_max_nodes)
        return choose_shapes(self.controller, batch, ks, prefill, cands, self.cfg.tree_margin)

    def _prediction(self, requests: list[RequestView], states: list[RequestState],
                    out: list[StepChoice], batch: Batch, policy_k: list[bool],
                    prefill: int) -> StepPrediction | None:
        """The cost model's account of the step chosen (None without one, or when no k is the
        controller's), with the chains' expected lengths and what the scoring calls add."""
        for r, c in zip(requests, out):
            self.chains.chosen(r.request_id, c)
        work = self.scoring.work(requests, states, out)
        if not any(policy_k) or self.controller.cost is None:
            return None
        ks = [self.chains.expected_k(c) for c in out]
        drafts, verify = self.controller.predicted_parts(
            batch, ks, prefill,
            [nodes(c.branching, c.k) + 1 if c.branching else k + 1 for c, k in zip(out, ks)])
        extra = self.scoring_cost.predict(*work)
        plain = (verify if not any(ks) and not any(c.branching for c in out)  # a plain plan
                 else self.controller.predicted_parts(batch, [0] * len(batch), prefill)[1])
        expected = self.controller.expected(  # (a held chain's head: priced without drafting)
            [(rid, c.drafter, n) for (rid, _, n), c in zip(batch, out)], ks)
        return StepPrediction(self.controller.step_s(drafts, verify + extra), drafts, verify,
                              work, extra, plain, prefill, expected)

    # ---- what happened ---------------------------------------------------------------------------

    def observe(self, outcome: StepOutcome) -> None:
        """A verified step: first the scores its drafters measured, then each verified request's
        drafting, then the step's times against their prediction (calibration). A request
        released meanwhile (failed, cancelled) is left out: its state is gone for good."""
        known = [r for r in outcome.requests if r.request_id in self._requests]
        for r in known:
            self.head_chains.verified(r.request_id, r.verified)
            for score in r.scores:
                self._observe_score(r.request_id, score)
        for r in known:
            if r.verified:
                self._observe_request(r, outcome.draft_wait_s, outcome.verify_wait_s)
        if outcome.prediction is not None and outcome.prediction.step_s > 0:
            self._calibrate(outcome.prediction, outcome.draft_s, outcome.rest_s)
        self.guard.weigh(outcome)

    def _observe_request(self, r: RequestOutcome, draft_s: float, verify_s: float) -> None:
        """One request's step (``draft_s`` + ``verify_s``: what it waited). With ``ranks``
        (greedy drafts), a tree's acceptance evidence is its first-ranked path, and its
        runner-ups' record is updated (``tree_choice.py``)."""
        choice, accepted, ranks = r.choice, r.accepted, r.ranks
        if ranks is not None and choice.drafter is not None:
            self.runner_ups.observe(r.request_id, choice.drafter, ranks.trials, ranks.hits)
        first = ranks.first_accepted if ranks is not None and choice.branching else accepted
        state = self._requests.setdefault(r.request_id, RequestState())
        chosen, state.chosen = state.chosen, None
        self.chains.observe(r.request_id, choice)  # choice.k: the length it drafted
        if state.prefill:  # the target's prefill makes it no drafter's measure
            state.prefill = False
            if choice.drafter is not None:
                self.controller.observe(r.request_id, choice.drafter, choice.k, first)
            return
        if choice.drafter is None:
            if chosen is not None:  # the bandit's pick gave a plain step: its tokens (several
                # in a hold) to the bandit, a step of aging per forward to the estimate
                state.idle += max(0, r.emitted - 1)  # a hold's further forwards: at k = 0
                self.selector.update(r.request_id, chosen, r.emitted or 1, draft_s + verify_s)
                self.controller.tracker.relax(r.request_id, chosen, max(1, r.emitted))
            return
        seconds = draft_s + verify_s + self.selector.switch_cost_s(r.request_id, choice.drafter)
        self.selector.update(r.request_id, choice.drafter, accepted + 1, seconds)
        self.controller.observe(r.request_id, choice.drafter, choice.k, first)
        self.fit.record(r.request_id, choice.drafter, accepted, float(accepted < choice.k))

    def _observe_score(self, request_id: str, score: Score) -> None:
        """Seed the request's acceptance estimate and bandit prior of the drafter from its
        agreement with the request's own output, or for sampling from ``score.accepted``, the
        estimate of what its sampled drafts would get accepted (module doc); before there is
        output, the score is of the prompt (``prompt_fit.py``)."""
        drafter, matches, positions = score.drafter, score.matches, score.positions
        if positions <= 0:
            return
        state = self._requests.setdefault(request_id, RequestState())
        if not state.scored:
            self.fit.observe_prompt(request_id, drafter, matches, positions)
            return
        hits = (min(float(positions), max(0.0, score.accepted))
                if score.accepted is not None and self.cfg.sampled_scores else matches)
        self.fit.record(request_id, drafter, hits, positions - hits)
        keep = 1.0 - self.controller.cfg.ema  # earlier rounds weigh less: the output changes
        self.controller.tracker.add_evidence(request_id, drafter, hits, positions - hits, keep)
        total = state.agreement.setdefault(drafter, [0.0, 0.0])
        total[:] = [keep * total[0] + hits, keep * total[1] + positions]
        self._prior_from_rate(request_id, drafter, (total[0] + 0.5) / (total[1] + 1.0),
                              state.ctx)

    def _fit_value(self, request_id: str, drafter: str, rate: float) -> float:
        """What ranks drafters for the prompt fit (``PromptFit.value``) and runner-up rounds:
        with ``fit_by_goodput`` and a cost model the goodput at acceptance ``rate``, else it."""
        state = self._requests.get(request_id)
        best = (self.controller.solo_goodput(request_id, drafter, rate,
                                             state.ctx if state is not None else 0)
                if self.cfg.fit_by_goodput else None)
        return rate if best is None else best

    def _prior_from_rate(self, request_id: str, drafter: str, rate: float, ctx: int) -> None:
        """The request's bandit prior of ``drafter`` at acceptance ``rate`` (``score_trials``
        steps): the population's measured goodput of it times the cost model's goodput at
        ``rate`` over that at the population's acceptance (the prediction alone without a
        measure): the arms stay on one scale, round trips and the services' work included."""
        best = self.controller.solo_goodput(request_id, drafter, rate, ctx)
        pop = self.controller.tracker.prior(drafter, request_id)
        if best is None:  # no cost model: rescale the population prior instead
            self.selector.scale_prior(request_id, drafter,
                                      expected_tokens(rate, 4) / expected_tokens(pop, 4))
            return
        measured = self.selector.population_reward(request_id, drafter)
        at_pop = self.controller.solo_goodput(request_id, drafter, pop, ctx)
        if measured is not None and at_pop:
            best = measured * best / at_pop
        self.selector.set_prior(request_id, drafter, best, self.cfg.score_trials)

    def set_cost_model(self, cost: CostModel | None) -> None:
        self.controller.set_cost(cost)  # calibration starts again from it

    def _calibrate(self, prediction: StepPrediction, draft_s: Mapping[str, float],
                   rest_s: float) -> None:
        """Calibrate the cost model on the served step (``SpecLengthController.calibrate``); a
        step whose drafters scored meanwhile fits what scoring adds (``scoring_cost.py``)."""
        self.controller.calibrate(prediction, draft_s, rest_s, verification=not (
            prediction.scoring_work[0] or prediction.prefill_tokens))
        if prediction.scoring_work[0]:  # what the scoring calls added to the verification
            self.scoring_cost.observe(*prediction.scoring_work, rest_s - prediction.verify_s)

    def measured(self) -> Mapping[StepKind, tuple[float, float, bool]]:
        return self.guard.rates()

    def calibration(self) -> Mapping[tuple[str, str], float]:
        return self.controller.calibration.factors()

    def release(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        for part in (self.guard, self.fit, self.selector, self.controller, self.chains,
                     self.runner_ups, self.head_chains):
            part.release(request_id)
