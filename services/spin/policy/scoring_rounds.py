"""Who scores a request in the learned policy (``learned.py``), when, and what those calls feed.

A scoring drafter predicts tokens the request already has (greedy, each from the tokens before
it) and the router reports how many it got right (``Policy.observe_score``). The rounds:

- **the prompt**, at a request's first step (``prompt_fit``): every model drafter worth it
  (``PromptFit.worth_scoring``) prefills the prompt while the target does;
- **output rounds**, once the request has generated ``score_after`` tokens and then every
  ``score_every``, at most ``score_rounds``: each of its candidates scores its output;
- **lookup rescoring**, after the first output round (``lookup_rescore``): prompt lookup, free in
  the router, scores every step's new tokens while another drafter drafts;
- **runner-up rounds**, every ``runner_up_every`` generated tokens (off by default). Prompt
  agreement ranks the drafters well, not perfectly (``prompt_fit.py``): a general model may
  predict a structured prompt as well as the specialist and accept far less on the output, and a
  request's output may change its kind as it goes. The model drafters that came within
  ``runner_up_margin`` of the best prompt agreement score the tokens since their last call (their
  cache holds the rest). One that predicted those tokens better than the best-fitting drafter
  accepted on its own steps meanwhile (its acceptance estimate when it made none), by more than
  ``runner_up_switch``, fits the request from then on (the one it replaces becomes a runner-up);
  with ``fit_by_goodput``, better is by the goodput predicted at those rates. In serving their
  scoring calls cost more than they gain (``LearnedPolicyConfig.runner_up_every``).

Model drafters' scoring calls run beside the verification; ``work`` counts them and the tokens
they feed for the step's prediction (``scoring_cost.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from .acceptance import AcceptanceTracker
from .base import PROMPT_LOOKUP, RequestView, StepChoice
from .learned_config import LearnedPolicyConfig
from .prompt_fit import PromptFit
from .request_state import RequestState

log = logging.getLogger(__name__)


@dataclass
class ScoringRounds:
    """The learned policy's scoring decisions (module doc). Their per-request state is the
    request's ``RequestState`` (``scored``, ``fed``, ``own``, ``next_round``,
    ``pending_runners``, ``runner_window``)."""

    cfg: LearnedPolicyConfig
    """The learned policy's settings (read at each use): ``score_after``, ``score_every``,
    ``score_rounds``, ``prompt_fit``, ``lookup_rescore`` and the ``runner_up_*`` ones."""
    fit: PromptFit
    """The requests' prompt agreement and best-fitting drafters."""
    tracker: AcceptanceTracker
    """The best-fitting drafter's acceptance estimate, when it made no step in a runner-up
    round's window."""
    value: Callable[[str, str, float], float]
    """(request id, drafter, acceptance rate) -> what ranks the drafters (the learned policy's
    ``_fit_value``)."""

    def scorers(self, r: RequestView, state: RequestState, drafter: str | None,
                cands: set[str], available: set[str]) -> tuple[str, ...]:
        """The drafters that score the request this step (mode auto only), sorted; ``drafter``
        is its drafter this step, ``cands`` its candidates."""
        if r.mode != "auto":
            return ()
        cfg, rounds = self.cfg, state.scored
        score: tuple[str, ...] = ()
        if not cfg.score_after:
            pass
        elif r.generated == 0 and cfg.prompt_fit and r.remaining > cfg.score_after:
            score = self.fit.worth_scoring(available - {PROMPT_LOOKUP})  # the prompt
        elif (rounds < cfg.score_rounds and r.generated >= cfg.score_after
              + rounds * (cfg.score_every or cfg.score_after)):
            state.scored = rounds + 1
            score = tuple(sorted(cands))
        elif (rounds and cfg.lookup_rescore and drafter != PROMPT_LOOKUP
              and PROMPT_LOOKUP in cands):
            score = (PROMPT_LOOKUP,)
        return tuple(sorted({*score, *self._runners_up(r, state, available)}))

    def _runners_up(self, r: RequestView, state: RequestState,
                    available: set[str]) -> tuple[str, ...]:
        """The runner-ups that score the request's output this step, when a round is due after
        its first output round; () otherwise."""
        every = self.cfg.runner_up_every
        due = every if state.next_round is None else state.next_round
        if not every or not state.scored or r.remaining <= every or r.generated < due:
            return ()
        state.next_round = r.generated + every
        runners = tuple(n for n in self.fit.runners_up(r.request_id, self.cfg.runner_up_margin)
                        if n in available)
        own, state.own = state.own, {}  # the best-fitting drafter's steps since the last round
        if runners:
            state.pending_runners, state.runner_window = set(runners), own
        return runners

    def judge(self, request_id: str, state: RequestState, runner: str, agreement: float) -> None:
        """``runner`` predicted ``agreement`` of the request's tokens since its last call: a
        runner-up of the pending round fits the request best from now on if that beats the
        best-fitting drafter by the rule of the module doc (one switch per round)."""
        fitting = self.fit.fitting(request_id)
        if not fitting or runner not in state.pending_runners:
            return
        state.pending_runners.discard(runner)
        best = fitting[0]
        accepted, rejected = state.runner_window.get(best, (0.0, 0.0))
        rate = (accepted / (accepted + rejected) if accepted + rejected
                else self.tracker.get(request_id, best))
        if self.value(request_id, runner, agreement) > self.value(
                request_id, best, min(1.0, rate + self.cfg.runner_up_switch)):
            log.debug("request %s: %s fits better than %s (%.2f against %.2f)", request_id,
                      runner, best, agreement, rate)
            self.fit.promote(request_id, runner)
            state.pending_runners.clear()

    @staticmethod
    def work(requests: list[RequestView], states: list[RequestState],
             out: list[StepChoice]) -> tuple[int, int]:
        """(calls, tokens fed) of the model drafters scoring beside the verification this step:
        each feeds the tokens its drafter has not seen yet (the whole prompt at a request's first
        step). Prompt lookup scores in the router before the verification; a request's own
        drafter drafts instead."""
        calls = tokens = 0
        for r, s, c in zip(requests, states, out):
            for name in c.score:
                if name != PROMPT_LOOKUP and name != c.drafter:
                    calls += 1
                    tokens += r.context_len - s.fed.get(name, 0)
                    s.fed[name] = r.context_len
            if c.drafter is not None and c.drafter != PROMPT_LOOKUP:
                s.fed[c.drafter] = r.context_len
        return calls, tokens
