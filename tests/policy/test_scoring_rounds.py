"""ScoringRounds: who scores a request when (prompt, output rounds, lookup rescoring), and what
the calls feed."""

from __future__ import annotations

from spin.policy.base import PROMPT_LOOKUP, RequestView, StepChoice
from spin.policy.learned_config import learned_config
from spin.policy.prompt_fit import PromptFit
from spin.policy.request_state import RequestState
from spin.policy.scoring_cost import ScoringCost
from spin.policy.scoring_rounds import ScoringRounds

MODELS = {"draft-code", "draft-prose"}
DRAFTERS = MODELS | {PROMPT_LOOKUP}


def _rounds(**overrides) -> ScoringRounds:
    return ScoringRounds(learned_config(overrides), PromptFit(prune_after=0))


def _view(generated: int, mode: str = "auto", remaining: int = 100) -> RequestView:
    return RequestView("r", 100 + generated, generated, remaining, True, mode)


def test_the_prompt_then_output_rounds_then_prompt_lookup_rescoring() -> None:
    rounds, state = _rounds(score_rounds=2, score_every=10), RequestState()
    asked = {g: rounds.scorers(_view(g), state, "draft-code", DRAFTERS, DRAFTERS)
             for g in range(0, 30)}
    assert asked[0] == ("draft-code", "draft-prose")  # every model drafter scores the prompt
    assert asked[4] == tuple(sorted(DRAFTERS)) and asked[14] == tuple(sorted(DRAFTERS))
    assert state.scored == 2
    assert asked[5] == asked[20] == (PROMPT_LOOKUP,)  # free: the new tokens of every step
    assert rounds.scorers(_view(29), state, PROMPT_LOOKUP, DRAFTERS, DRAFTERS) == ()
    assert rounds.scorers(_view(0, "off"), RequestState(), None, set(), DRAFTERS) == ()
    short = _view(0, remaining=4)  # ends before its first output round: no prompt scoring
    assert rounds.scorers(short, RequestState(), PROMPT_LOOKUP, DRAFTERS, DRAFTERS) == ()


def test_work_counts_the_model_drafters_calls_and_the_tokens_each_has_not_seen() -> None:
    state = RequestState()
    first = [StepChoice(PROMPT_LOOKUP, 4, score=("draft-code", "draft-prose"))]
    assert ScoringRounds.work([_view(0)], [state], first) == (2, 200)  # both prefill 100 tokens
    later = [StepChoice("draft-code", 4, score=("draft-code", "draft-prose", PROMPT_LOOKUP))]
    # draft-code drafts (no scoring call), prompt lookup scores in the router: draft-prose only
    assert ScoringRounds.work([_view(7)], [state], later) == (1, 7)
    assert state.fed == {"draft-code": 107, "draft-prose": 107}


def _cost(per_call: float) -> ScoringCost:
    """A scoring cost learnt from served steps: ``per_call`` seconds per call, nothing per token."""
    cost = ScoringCost()
    for calls in (1, 2, 3, 4, 2, 1):
        cost.observe(calls, 0, per_call * calls)
    return cost


def test_scoring_calls_go_ahead_only_while_speculation_can_return_their_cost() -> None:
    rounds = _rounds()
    prompt = ("draft-code", "draft-prose")
    view = _view(0, remaining=50)  # 50 tokens left to gain on
    # speculating saves 1 ms a token: 50 ms at most against 2 x 10 ms of scoring, which goes on
    assert rounds.priced(view, RequestState(), None, prompt, 1e-3, _cost(0.010)) == prompt
    # against 2 x 40 ms it is dropped; a loss (negative saving) drops it at any price
    assert rounds.priced(view, RequestState(), None, prompt, 1e-3, _cost(0.040)) == ()
    assert rounds.priced(view, RequestState(), None, prompt, -1e-4, _cost(0.001)) == ()
    # no served scoring step yet: as chosen (so their cost gets measured), saving or not
    assert rounds.priced(view, RequestState(), None, prompt, 1e-3, ScoringCost()) == prompt
    assert rounds.priced(view, RequestState(), None, prompt, None, ScoringCost()) == prompt
    # their cost measured but no saving known: nothing to pay with, however cheap
    assert rounds.priced(view, RequestState(), None, prompt, None, _cost(0.001)) == ()
    # 30 ms for one 40 ms call: dropped, but prompt lookup (free) and the own drafter stay
    later = ("draft-code", "draft-prose", PROMPT_LOOKUP)
    assert rounds.priced(_view(6, remaining=30), RequestState(), "draft-code", later, 1e-3,
                         _cost(0.040)) == ("draft-code", PROMPT_LOOKUP)
    off = _rounds(price_scoring=False)
    assert off.priced(view, RequestState(), None, prompt, 1e-3, _cost(0.040)) == prompt

