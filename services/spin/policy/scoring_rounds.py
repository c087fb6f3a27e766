"""Who scores a request in the learned policy (``learned.py``), when, and what those calls feed.

A scoring drafter predicts tokens the request already has (greedy, each from the tokens before
it) and the step's ``outcome.StepOutcome`` reports how many it got right. The rounds:

- **the prompt**, at a request's first step (``prompt_fit``): every model drafter worth it
  (``PromptFit.worth_scoring``) prefills the prompt while the target does;
- **output rounds**, once the request has generated ``score_after`` tokens and then every
  ``score_every``, at most ``score_rounds``: each of its candidates scores its output;
- **lookup rescoring**, after the first output round (``lookup_rescore``): the model-free
  drafters (prompt lookup, suffix decoding: ``engine/model_free.py``), free in the router, score
  every step's new tokens while another drafter drafts.

What a score means. With greedy decoding a draft token is accepted exactly when it equals the
target's token, so agreement on the target's own output *is* the drafter's acceptance rate on this
request. With sampling it is not: a sampled draft token x is accepted with probability min(1,
p(x)/q(x)), on average sum_x min(p, q) per position, and the demo drafters' greedy agreement with
sampled output (temperature 0.8, top-p 0.95) is about half of that (0.25 against 0.44 for draft-
code, 0.29 against 0.60 for draft-general, on 12 tuning prompts). So for a sampling request the
router sends the target's probability p(x) of each output token (the verifier's), the drafter adds
up min(1, q(x)/p(x)) over the scored tokens, an unbiased estimate of that sum since x was drawn from
p, and that counts as the accepted tokens instead (``outcome.Score.accepted``). Each scored position
counts as one accepted or rejected draft token in the request's acceptance estimate for the drafter,
and the drafter's bandit prior (own steps kept) becomes the goodput the cost model predicts at the
best k for that rate. Without the prompt fit every drafter scores, so a request learns which drafter
fits it from one round of prefills instead of one slow exploratory step per drafter. After that
round prompt lookup, which costs nothing but a scan in the router, rescores every step's new tokens
while a model drafts (``lookup_rescore``): the small target models this project trains, like larger
ones on code and structured text, fall into repeating spans, where prompt lookup drafts k tokens for
free and all are accepted. Each round weighs ``1 - controller.ema`` of the next, so its estimate
follows the recent output.

Model drafters' scoring calls run beside the verification; ``work`` counts them and the tokens
they feed for the step's prediction (``scoring_cost.py``).

What a score may cost (``priced``). A scoring call is work done for speculation's sake: it can
return at most what speculating saves over the request's remaining tokens. So the model
drafters' calls of a request go ahead only while their predicted seconds (``ScoringCost``,
learnt in serving) are at most its remaining tokens times the seconds of step that speculating
saves per token in its kind of step (``saving``: measured at that batch size or a larger one,
else predicted by the cost model for the step's plan); before their cost is measured they go
ahead (so that it can be), after that only against a known saving. Both are measured in
serving, so no threshold is set by hand. A request whose prompt was not scored chooses among
all drafters by their population statistics. Before 2026-11-27 an unknown saving let the calls
through, and a smaller batch's measured one was lent: the prompt-fit calls of arriving greedy
requests then ran at 32-63 in flight, in steps of 325 ms against 136 ms without them (an
evaluation grid, where auto measured 0.86x-0.94x off there; in a tuning run of the cell at 32,
logged, all 48 decisions went ahead with no saving known, 0.872x off).
Measured (``spin bench grid --split tuning --temperatures 0 --concurrency 32 --prompts long
--rounds 1``, 2-core CPU, calls logged): in batches of 32-63 greedy requests the rule let a
request's four calls (40-54 ms predicted) go ahead against 45-60 ms saved over its 64 tokens, so
on this machine it drops few; where speculation saves less per token it drops them. Weighing
only the share of the saving that the fitted drafter's better acceptance brings (1 - best
population rate / fitted record) dropped half the calls at batch 32-63 and nearly all at 16-31,
but also most at batch 1, where short greedy single streams then measured 0.98x off.

What a catch-up may cost (``unaffordable``). A model drafter that has not seen a request's
context prefills it on its first call, drafting or scoring alike: the same work, priced the
same way. So a request may start drafting with such a drafter only while that catch-up's
predicted seconds are at most its remaining tokens times the saving; model-free drafters and
heads (inside the verifier) need none. Measured before the rule (``spin bench grid
--temperatures 0.8 --repeat-off``, evaluation split, 2-core CPU, step trace): at one sampled
request a step in which a model drafter first drafted or scored took 37-55 ms against 15 ms for
a plain step; 100 of the 114 such steps of the run came in its first 40 s, and that cell
measured 0.90x off against a noise floor (off against itself) of 0.975x.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import MODEL_FREE, RequestView, StepChoice
from .goodput import SpecLengthController
from .learned_config import LearnedPolicyConfig
from .loss_guard import LossGuard, StepKind
from .prompt_fit import PromptFit
from .request_state import RequestState
from .scoring_cost import ScoringCost


@dataclass
class ScoringRounds:
    """The learned policy's scoring decisions (module doc). Their per-request state is the
    request's ``RequestState`` (``scored``, ``fed``)."""

    cfg: LearnedPolicyConfig
    """The learned policy's settings (read at each use): ``score_after``, ``score_every``,
    ``score_rounds``, ``prompt_fit`` and ``lookup_rescore``."""
    fit: PromptFit
    """The requests' prompt agreement and best-fitting drafters."""

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
            score = self.fit.worth_scoring(available - MODEL_FREE)  # the prompt
        elif (rounds < cfg.score_rounds and r.generated >= cfg.score_after
              + rounds * (cfg.score_every or cfg.score_after)):
            state.scored = rounds + 1
            score = tuple(sorted(cands))
        elif rounds and cfg.lookup_rescore and (free := cands & MODEL_FREE - {drafter}):
            score = tuple(free)  # the model-free candidates: free to score
        return tuple(sorted(score))

    def unaffordable(self, r: RequestView, state: RequestState, cands: set[str],
                     heads: frozenset[str], saving: float | None, cost: ScoringCost
                     ) -> set[str]:
        """The model drafters of ``cands`` the request may not start drafting with: those that
        have not seen its context, whose catch-up (the tokens they have not seen, fed like a
        scoring call's) costs more than speculating saves over its remaining tokens (module
        doc: what a catch-up may cost). Model-free drafters and heads are never among them."""
        if not (self.cfg.price_catch_up and saving is not None and cost.steps):
            return set()
        return {d for d in cands - heads - MODEL_FREE
                if (fed := r.context_len - state.fed.get(d, 0)) > 0
                and r.remaining * saving < cost.predict(1, fed)}

    def priced(self, r: RequestView, state: RequestState, drafter: str | None,
               score: tuple[str, ...], saving: float | None, cost: ScoringCost
               ) -> tuple[str, ...]:
        """``score`` less its model drafters' calls when those cost more than speculation can
        return (module doc): ``saving`` is the seconds that speculating saves per token in the
        request's kind of step (None: not known, so nothing to pay with once ``cost`` has
        measured such calls), ``cost`` predicts the calls' seconds.
        Model-free drafters' scores and the request's own drafter's (it drafts anyway) stay."""
        calls = [n for n in score if n not in MODEL_FREE and n != drafter]
        if not (self.cfg.price_scoring and calls and cost.steps):
            return score  # their cost not measured yet: they go ahead, so it can be
        fed = sum(r.context_len - state.fed.get(n, 0) for n in calls)
        if saving is not None and r.remaining * saving >= cost.predict(len(calls), fed):
            return score
        return tuple(n for n in score if n not in calls)

    @staticmethod
    def saving(guard: LossGuard, controller: SpecLengthController, kind: StepKind,
               batch: list[tuple[str, str | None, int]], ks: list[int],
               extra: int) -> float | None:
        """The saving per token that prices scoring calls (``priced``): measured at this kind
        of step or a larger batch (``LossGuard.saving`` with ``at_least``), else what the cost
        model predicts this step's plan (``ks``) saves; None when neither is known."""
        measured = guard.saving(kind, at_least=True)
        return measured if measured is not None else controller.predicted_saving(batch, ks,
                                                                                 extra)

    @staticmethod
    def work(requests: list[RequestView], states: list[RequestState],
             out: list[StepChoice]) -> tuple[int, int]:
        """(calls, tokens fed) of the model drafters scoring beside the verification this step:
        each feeds the tokens its drafter has not seen yet (the whole prompt at a request's first
        step). Model-free drafters score in the router before the verification; a request's own
        drafter drafts instead."""
        calls = tokens = 0
        for r, s, c in zip(requests, states, out):
            for name in c.score:
                if name not in MODEL_FREE and name != c.drafter:
                    calls += 1
                    tokens += r.context_len - s.fed.get(name, 0)
                    s.fed[name] = r.context_len
            if c.drafter is not None and c.drafter not in MODEL_FREE:
                s.fed[c.drafter] = r.context_len
        return calls, tokens
