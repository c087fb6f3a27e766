"""Suffix decoding gets what prompt lookup gets: every special case of a model-free drafter
(no catch-up, no switching cost, a first-step candidate, free rescoring, no candidate without a
match, priced as prompt lookup) holds for both."""

from __future__ import annotations

from dataclasses import replace

import pytest

from policy.steps import observe, observe_score, without_guard
from spin.engine.prediction import PREDICTION
from spin.engine.suffix_decoding import SUFFIX_DECODING
from spin.policy.base import MODEL_FREE, PROMPT_LOOKUP, RequestView, branches, unmatched
from spin.policy.learned import LearnedPolicy, learned_config
from spin.policy.request_state import RequestState
from spin.policy.selector import SelectorConfig
from spin.stats.store import DrafterStats
from spin.timing.cost_model import CostModel

DRAFTERS = {"draft-code", "draft-prose", PROMPT_LOOKUP, SUFFIX_DECODING}


@pytest.fixture(autouse=True)
def _no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    without_guard(monkeypatch)


def _cost() -> CostModel:
    return CostModel(verify=(0.010, 0.0, 1e-4, 0.0, 0.0),
                     draft={d: (0.0, 0.001, 0.0, 0.0) for d in ("draft-code", "draft-prose")})


def _stats(drafts: int, accepted: int, k: int = 4) -> DrafterStats:
    return DrafterStats(drafts=drafts, draft_tokens=drafts * k, accepted_tokens=accepted,
                        draft_seconds=drafts * 0.004, verify_seconds=drafts * 0.011)


def _view(rid: str, generated: int, lookup: bool = False, suffix: int = 1) -> RequestView:
    return RequestView(rid, 200 + generated, generated, 100, True, lookup_match=lookup,
                       free_branches=((SUFFIX_DECODING, suffix),))


def test_both_are_model_free_and_the_view_says_which_would_draft() -> None:
    assert {PROMPT_LOOKUP, SUFFIX_DECODING, PREDICTION} <= MODEL_FREE
    v = _view("r", 3, lookup=False, suffix=2)
    assert (branches(v, PROMPT_LOOKUP), branches(v, SUFFIX_DECODING)) == (0, 2)
    assert unmatched(v) == {PROMPT_LOOKUP}
    assert unmatched(_view("r", 3, lookup=True, suffix=0)) == {SUFFIX_DECODING}
    assert SelectorConfig().switch_free == MODEL_FREE  # no switching cost for either
    cost = _cost()
    assert cost.has_drafter(SUFFIX_DECODING)  # priced as prompt lookup: per request and step
    assert cost.predict_draft(SUFFIX_DECODING, 4, 8, 1000) == pytest.approx(
        cost.predict_draft(PROMPT_LOOKUP, 4, 8, 1000)) == pytest.approx(4 * cost.prompt_lookup_s)


def test_suffix_decoding_drafts_at_the_first_step_and_only_where_it_matches() -> None:
    pop = {"draft-code": _stats(100, 200), "draft-prose": _stats(100, 200),
           SUFFIX_DECODING: _stats(100, 380), PROMPT_LOOKUP: _stats(100, 40)}
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    try:
        (c,) = policy.choose([_view("p", 0, suffix=0)], DRAFTERS)
        assert c.drafter is None and c.score  # neither model-free drafter would draft
        assert SUFFIX_DECODING not in c.score  # the models score the prompt, not those
        (c,) = policy.choose([_view("q", 0)], DRAFTERS)
        assert c.drafter == SUFFIX_DECODING and c.k > 0  # a first-step candidate, matched
        assert c.stop_below == 0.0  # its chain does not stop early: no probabilities
        observe_score(policy, "q", "draft-prose", 60, 128)
        observe_score(policy, "q", "draft-code", 20, 128)
        observe(policy, "q", c, c.k, 0.0, 0.080)
        (c,) = policy.choose([_view("q", 1 + c.k, lookup=True)], DRAFTERS)
        assert c.drafter == SUFFIX_DECODING  # beside the fitted model and prompt lookup
        (c,) = policy.choose([_view("q", 20, lookup=False, suffix=0)], DRAFTERS)
        assert c.drafter == "draft-prose" and c.k > 0  # no match: the fitted model drafts
    finally:
        policy.close()


def test_both_rescore_for_free_and_need_no_catch_up() -> None:
    policy = LearnedPolicy(learned_config({"score_after": 4, "score_rounds": 1}), cost=_cost())
    try:
        scoring, s = policy.scoring, RequestState()
        s.scored = 1  # after the first output round
        view = replace(_view("r", 30, lookup=True), mode="auto")
        got = scoring.scorers(view, s, "draft-code", {"draft-code", *MODEL_FREE}, DRAFTERS)
        assert got == tuple(sorted(MODEL_FREE))  # both, free in the router
        got = scoring.scorers(view, s, SUFFIX_DECODING, {"draft-code", *MODEL_FREE}, DRAFTERS)
        assert got == tuple(sorted(MODEL_FREE - {SUFFIX_DECODING}))  # those not drafting
        assert scoring.priced(view, s, "draft-code", tuple(sorted(MODEL_FREE)), 1e-9,
                              policy.scoring_cost) == tuple(sorted(MODEL_FREE))
    finally:
        policy.close()
