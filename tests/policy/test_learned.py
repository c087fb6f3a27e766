"""The learned policy: bandit drafter choice per request, goodput-chosen k, population warm start."""

from __future__ import annotations

from dataclasses import replace

import pytest

from spin.policy.base import PROMPT_LOOKUP, RequestView, StepChoice, StepPrediction
from spin.timing.cost_model import CostModel
from spin.policy.chain_length import EMA
from spin.policy.goodput import SpecLengthController
from spin.policy.head_chains import HeadChains, pays
from spin.policy.learned import LearnedPolicy, learned_config
from spin.policy.loss_guard import step_kind
from spin.policy.outcome import RequestOutcome, StepOutcome
from spin.stats.store import DrafterStats
from policy.steps import observe, observe_score, observe_step, without_guard


@pytest.fixture(autouse=True)
def _no_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    without_guard(monkeypatch)

DRAFTERS = {"draft-code", "draft-prose", PROMPT_LOOKUP}


def _view(rid: str, mode: str = "auto", drafter: str | None = None, k: int = 0,
          remaining: int = 100) -> RequestView:
    return RequestView(rid, 200, 10, remaining, True, mode, drafter, k)


def _cost(verify_per_token: float = 1e-4) -> CostModel:
    """Verification 10 ms + a little per scored token; each draft level 1 ms."""
    return CostModel(verify=(0.010, 0.0, verify_per_token, 0.0, 0.0),
                     draft={d: (0.0, 0.001, 0.0, 0.0) for d in ("draft-code", "draft-prose")})


def _stats(drafts: int, accepted: int, k: int = 4) -> DrafterStats:
    return DrafterStats(drafts=drafts, draft_tokens=drafts * k, accepted_tokens=accepted,
                        draft_seconds=drafts * 0.004, verify_seconds=drafts * 0.011)


def test_modes_off_and_named_drafter_are_respected() -> None:
    policy = LearnedPolicy(cost=_cost())
    out = policy.choose([_view("a", "off"), _view("b", "drafter", "draft-prose", 3)], DRAFTERS)
    assert out[0].drafter is None and out[0].k == 0
    assert out[1].drafter == "draft-prose" and out[1].k == 3


def test_only_auto_chains_of_model_drafters_may_stop_early() -> None:
    """A model drafter's chain in mode auto carries ``stop_below``, and a named drafter's fixed
    k only when the client asks (``early_stop``); prompt lookup (no probabilities) never."""
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 10)}
    policy = LearnedPolicy(learned_config({"stop_below": 0.25, "score_after": 0}), _cost(),
                           population=lambda: pop)
    try:
        auto, named, lookup = policy.choose(
            [_view("a"), _view("b", "drafter", "draft-prose", 3),
             _view("c", "drafter", PROMPT_LOOKUP, 4)], DRAFTERS)
        assert (auto.drafter, auto.stop_below) == ("draft-code", 0.25) and auto.k > 0
        assert (named.k, named.stop_below) == (3, 0.0)
        assert (lookup.drafter, lookup.stop_below) == (PROMPT_LOOKUP, 0.0)
        stopping, lookup = policy.choose(
            [replace(_view("d", "drafter", "draft-prose", 16), early_stop=True),
             replace(_view("e", "drafter", PROMPT_LOOKUP, 16), early_stop=True)], DRAFTERS)
        assert (stopping.drafter, stopping.k, stopping.stop_below) == ("draft-prose", 16, 0.25)
        assert (lookup.k, lookup.stop_below) == (16, 0.0)
    finally:
        policy.close()


def test_the_step_prediction_follows_how_much_of_k_early_stopping_chains_draft() -> None:
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 10)}
    policy = LearnedPolicy(learned_config({"stop_below": 0.2, "score_after": 0, "trees": False}),
                           _cost(),
                           population=lambda: pop)
    try:
        plan = policy.choose([_view("a")], DRAFTERS)
        (first,) = plan
        assert first.drafter == "draft-code" and first.k >= 4
        _, verify = policy.controller.predicted_parts([("a", "draft-code", 200)], [first.k])
        assert plan.prediction.verify_s == pytest.approx(verify)  # nothing seen yet
        c, fraction = first, 1.0
        for _ in range(5):  # every chain stops at half its k (all of it accepted)
            observe(policy, "a", replace(c, k=c.k // 2), c.k // 2, 0.01, 0.01)
            fraction += EMA * ((c.k // 2) / c.k - fraction)
            plan = policy.choose([_view("a")], DRAFTERS)
            (c,) = plan
        assert fraction < 0.8
        drafts, verify = policy.controller.predicted_parts([("a", "draft-code", 200)],
                                                           [c.k * fraction])
        assert plan.prediction.verify_s == pytest.approx(verify)
        assert plan.prediction.draft_s == pytest.approx(drafts)
    finally:
        policy.close()


def test_sampling_requests_start_from_the_sampled_population_statistics() -> None:
    """The population entries of greedy and sampled steps (``population_name``) seed each
    request by its decoding: here draft-code accepts 0.75 greedy and 0.1 sampled."""
    pop = {"draft-code": _stats(100, 300), "draft-code@sampled": _stats(100, 40),
           "draft-prose": _stats(100, 100), "draft-prose@sampled": _stats(100, 200)}
    policy = LearnedPolicy(learned_config({"score_after": 0}), _cost(), population=lambda: pop)
    try:
        g, s = policy.choose([_view("g"), replace(_view("s"), greedy=False)],
                             {"draft-code", "draft-prose"})
        assert (g.drafter, s.drafter) == ("draft-code", "draft-prose")
        tracker = policy.controller.tracker
        assert tracker.get("g", "draft-code") == pytest.approx(0.75)
        assert tracker.get("s", "draft-code") == pytest.approx(0.1)
        assert tracker.get("s", "draft-prose") == pytest.approx(0.5)
    finally:
        policy.close()


def test_population_prior_picks_the_best_drafter_first() -> None:
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 60)}
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    try:
        (choice,) = policy.choose([_view("a")], DRAFTERS)
        assert choice.drafter == "draft-code" and choice.k >= 3  # acceptance 0.75: speculate long
    finally:
        policy.close()


def test_a_request_learns_its_own_drafter_against_the_prior() -> None:
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 60)}
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    chosen = []
    try:
        for _ in range(40):  # this request is prose: draft-code never lands, draft-prose always
            (c,) = policy.choose([_view("p")], DRAFTERS)
            chosen.append(c.drafter)
            accepted = c.k if c.drafter == "draft-prose" else 0
            observe(policy, "p", c, accepted, 0.001 * c.k, 0.011)
        assert chosen[0] == "draft-code"
        assert chosen[-10:].count("draft-prose") >= 8, chosen
    finally:
        policy.close()


def test_no_speculation_when_nothing_is_accepted_then_a_probe() -> None:
    pop = {d: _stats(100, 0) for d in DRAFTERS}
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    policy.cfg.probe_every = 4
    try:
        ks = [policy.choose([_view("z")], DRAFTERS)[0].k for _ in range(6)]
        assert ks[:4] == [0, 0, 0, 0] and ks[4] == 1 and ks[5] == 0
    finally:
        policy.close()


def test_a_named_drafter_without_its_k_gets_the_controllers_alone_in_its_batch() -> None:
    """``--speculation draft-code`` without ``--k`` means the router's k, also in a batch with no
    request in mode auto (it was 0 there: no speculation but a probe every ``probe_every``)."""
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 10)}
    policy = LearnedPolicy(learned_config({"stop_below": 0.25, "trees": False}), _cost(),
                           population=lambda: pop)
    try:
        for _ in range(3):
            plan = policy.choose([_view("a", "drafter", "draft-code")], DRAFTERS)
            (c,) = plan
            assert (c.drafter, c.stop_below) == ("draft-code", 0.25) and c.k > 1
            assert plan.prediction.draft_s["draft-code"] > 0
            observe(policy, "a", c, c.k, 0.004, 0.011)
        (off, low) = policy.choose([_view("b", "off"), _view("c", "drafter", "draft-prose")],
                                   DRAFTERS)
        assert off.drafter is None and low.drafter in ("draft-prose", None)
        assert low.k < c.k  # its k from draft-prose's lower acceptance
    finally:
        policy.close()


def test_k_is_clipped_to_the_remaining_tokens() -> None:
    policy = LearnedPolicy(cost=_cost())
    (c,) = policy.choose([_view("a", "drafter", "draft-code", 8, remaining=3)], DRAFTERS)
    assert c.k == 2
    (c,) = policy.choose([_view("b", "drafter", "draft-code", 8, remaining=1)], DRAFTERS)
    assert c.drafter is None and c.k == 0


def test_predicted_step_time_is_exposed() -> None:
    policy = LearnedPolicy(learned_config({"trees": False}), cost=_cost())
    plan = policy.choose([_view("a")], DRAFTERS)
    (c,) = plan
    # verify 10 ms + (k + 1) scored tokens x 0.1 ms, plus k draft levels x 1 ms for a model drafter
    draft = 0.001 * c.k if c.drafter in ("draft-code", "draft-prose") else 1e-5
    p = plan.prediction
    assert c.k > 0 and abs(p.step_s - (0.010 + 1e-4 * (c.k + 1) + draft)) < 1e-6
    assert p.verify_s == pytest.approx(0.010 + 1e-4 * (c.k + 1))
    # what it is weighed against: the same step plain, and the tokens it expects
    a = policy.controller.tracker.get("a", c.drafter)
    assert p.plain_s == pytest.approx(0.010 + 1e-4) and p.prefill_tokens == 0
    assert p.tokens == pytest.approx((1 - a ** (c.k + 1)) / (1 - a))
    plan = policy.choose([_view("b", "drafter", "draft-code", 4)], DRAFTERS)
    assert plan.prediction is None  # nothing chosen by the model: nothing predicted
    # a first step: the verifier prefills the 200-token prompt as well as the k drafted tokens
    plan = policy.choose([RequestView("c", 200, 0, 100, True)], DRAFTERS)
    (c,) = plan
    assert plan.prediction.verify_s == pytest.approx(0.010 + 1e-4 * (200 + c.k))
    assert plan.prediction.prefill_tokens == 199
    # 160 of its tokens likely in the verifier's prefix cache: it computes the other 40
    plan = policy.choose([RequestView("d", 200, 0, 100, True, cached=160)], DRAFTERS)
    (c,) = plan
    assert plan.prediction.verify_s == pytest.approx(0.010 + 1e-4 * (40 + c.k))
    assert plan.prediction.prefill_tokens == 39


def _generated(rid: str, generated: int) -> RequestView:
    return RequestView(rid, 200 + generated, generated, 100, True)


def test_output_scores_pick_the_drafter_that_fits_the_request() -> None:
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 60)}
    policy = LearnedPolicy(learned_config({"prompt_fit": False}), cost=_cost(),
                           population=lambda: pop)
    try:
        (c,) = policy.choose([_generated("p", 0)], DRAFTERS)
        assert c.drafter == "draft-code" and c.score == ()  # the population's best, no scores yet
        observe(policy, "p", c, 0, 0.004, 0.011)
        (c,) = policy.choose([_generated("p", policy.cfg.score_after)], DRAFTERS)
        assert set(c.score) == DRAFTERS  # every drafter scores the request's output
        observe_score(policy, "p", "draft-prose", 15, 16)  # it predicts this request's text
        observe_score(policy, "p", "draft-code", 1, 16)
        observe_score(policy, "p", PROMPT_LOOKUP, 0, 16)
        (c,) = policy.choose([_generated("p", policy.cfg.score_after + 1)], DRAFTERS)
        assert c.drafter == "draft-prose" and c.k >= 4
        assert c.score == (PROMPT_LOOKUP,)  # free in the router: it rescores each step's tokens
        assert policy.controller.tracker.get("p", "draft-prose") > 0.8
        assert policy.controller.tracker.get("p", "draft-code") < 0.3
    finally:
        policy.close()


def test_a_sampled_score_s_acceptance_estimate_replaces_its_greedy_matches() -> None:
    """For a sampling request the drafter's estimate of what its sampled drafts get accepted is
    the acceptance evidence: greedy agreement with sampled output understates it."""
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 60)}
    rates = {}
    for accepted in (None, 40.0):
        policy = LearnedPolicy(learned_config({"prompt_fit": False}), cost=_cost(),
                               population=lambda: pop)
        try:
            (c,) = policy.choose([_generated("p", 0)], DRAFTERS)
            observe(policy, "p", c, 0, 0.004, 0.011)
            policy.choose([_generated("p", policy.cfg.score_after)], DRAFTERS)
            observe_score(policy, "p", "draft-prose", 16, 64, accepted)
            rates[accepted] = policy.controller.tracker.get("p", "draft-prose")
        finally:
            policy.close()
    assert rates[None] < 0.35 and rates[40.0] > 0.55


def test_prompt_scores_narrow_the_candidates_and_seed_the_next_fitted_request() -> None:
    pop = {"draft-code": _stats(100, 300), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 60)}
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    try:
        (c,) = policy.choose([_generated("p", 0)], DRAFTERS)
        # first step: prompt lookup drafts while every model drafter scores the prompt
        assert c.drafter in (PROMPT_LOOKUP, None) and set(c.score) == DRAFTERS - {PROMPT_LOOKUP}
        observe_score(policy, "p", "draft-prose", 60, 128)
        observe_score(policy, "p", "draft-code", 20, 128)
        observe(policy, "p", c, 0, 0.0, 0.080)  # the target's prefill: no reward for anyone
        assert policy.selector.snapshot("p")[PROMPT_LOOKUP][1] == 0
        assert policy.fit.fitting("p") == ("draft-prose",)
        used = set()
        for g in range(1, 30):  # the population prefers draft-code; it is never a candidate
            (c,) = policy.choose([_generated("p", g)], DRAFTERS)
            assert c.drafter in ("draft-prose", PROMPT_LOOKUP, None)
            assert set(c.score) <= {"draft-prose", PROMPT_LOOKUP}
            for name in set(c.score) - {c.drafter}:  # draft-prose predicts every output token
                observe_score(policy, "p", name, 4 if name == "draft-prose" else 0, 4)
            prose = c.drafter == "draft-prose"
            observe(policy, "p", c, c.k if prose else 0, 0.004 if prose else 0.0, 0.011)
            used.add(c.drafter)
        assert "draft-prose" in used
        assert policy.fit.acceptance("draft-prose") == 1.0
        policy.release("p")
        # the next request that fits draft-prose starts from how draft-prose did on p, not from
        # its poor population rate
        policy.choose([_generated("q", 0)], DRAFTERS)
        observe_score(policy, "q", "draft-prose", 50, 128)
        observe_score(policy, "q", "draft-code", 30, 128)
        assert policy.controller.tracker.get("q", "draft-prose") < 0.5
        (c,) = policy.choose([_generated("q", 1)], DRAFTERS)
        assert policy.controller.tracker.get("q", "draft-prose") > 0.7
        assert c.drafter == "draft-prose"
    finally:
        policy.close()


def test_a_drafter_fitting_its_first_request_starts_from_the_pooled_record() -> None:
    # both model drafters have poor population rates: each ran on every kind of request
    pop = {"draft-code": _stats(100, 60), "draft-prose": _stats(100, 40),
           PROMPT_LOOKUP: _stats(100, 60)}
    seeded = {}
    for pooled in (True, False):
        policy = LearnedPolicy(learned_config({"fit_pooled_seed": pooled}), cost=_cost(),
                               population=lambda: pop)
        try:
            policy.choose([_generated("p", 0)], DRAFTERS)  # p fits draft-prose and it accepts
            observe_score(policy, "p", "draft-prose", 60, 128)
            observe_score(policy, "p", "draft-code", 20, 128)
            policy.fit.record("p", "draft-prose", 15, 1)
            policy.release("p")
            assert policy.fit.acceptance("draft-code") is None  # no record of its own
            policy.choose([_generated("q", 0)], DRAFTERS)  # q fits draft-code
            observe_score(policy, "q", "draft-prose", 20, 128)
            observe_score(policy, "q", "draft-code", 60, 128)
            policy.choose([_generated("q", 1)], DRAFTERS)
            seeded[pooled] = policy.controller.tracker.get("q", "draft-code")
        finally:
            policy.close()
    assert seeded[True] > 0.7  # 15 of 16 on p, by the drafter that fitted it
    assert seeded[False] < 0.4  # the population's 60 of 400


def test_prompt_lookup_without_a_match_is_no_candidate_and_the_fitted_drafter_drafts() -> None:
    pop = {"draft-code": _stats(100, 200), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 380)}  # prompt lookup: the population's best by far
    policy = LearnedPolicy(cost=_cost(), population=lambda: pop)
    try:
        (c,) = policy.choose([replace(_generated("p", 0), lookup_match=False)], DRAFTERS)
        assert c.drafter is None and c.score  # its only candidate would not draft: a plain step
        observe_score(policy, "p", "draft-prose", 60, 128)
        observe_score(policy, "p", "draft-code", 20, 128)
        observe(policy, "p", c, 0, 0.0, 0.080)
        (c,) = policy.choose([_generated("p", 1)], DRAFTERS)
        assert c.drafter == PROMPT_LOOKUP and c.k > 0  # it matches: the bandit's pick
        before = policy.selector.snapshot("p")
        (c,) = policy.choose([replace(_generated("p", 2), lookup_match=False)], DRAFTERS)
        assert c.drafter == "draft-prose" and c.k > 0  # no match: the fitted model drafts
        observe(policy, "p", c, c.k, 0.004, 0.011)
        after = policy.selector.snapshot("p")
        assert after["draft-prose"][1] == before["draft-prose"][1] + 1
        assert after[PROMPT_LOOKUP] == before[PROMPT_LOOKUP]  # no match is not its measure
    finally:
        policy.close()


@pytest.mark.parametrize("by_goodput", [True, False])
def test_the_prompt_fit_prefers_a_cheap_drafter_to_a_costly_one_that_predicts_a_little_better(
        by_goodput: bool) -> None:
    cost = CostModel(verify=(0.010, 0.0, 1e-4, 0.0, 0.0),  # draft-prose: 6 ms a level
                     draft={"draft-code": (0.0, 0.001, 0.0, 0.0),
                            "draft-prose": (0.0, 0.006, 0.0, 0.0)})
    policy = LearnedPolicy(learned_config({"fit_by_goodput": by_goodput}), cost=cost)
    (c,) = policy.choose([_generated("p", 0)], DRAFTERS)
    observe_score(policy, "p", "draft-prose", 62, 100)
    observe_score(policy, "p", "draft-code", 60, 100)
    observe(policy, "p", c, 0, 0.0, 0.080)
    assert policy.fit.fitting("p") == (("draft-code",) if by_goodput else ("draft-prose",))
    (c,) = policy.choose([replace(_generated("p", 1), lookup_match=False)], DRAFTERS)
    if by_goodput:
        assert c.drafter == "draft-code" and c.k > 0
    else:  # the costly fit: k = 0 pays better than drafting with it
        assert c.drafter in ("draft-prose", None)


def test_scoring_rounds_are_spaced_and_bounded() -> None:
    policy = LearnedPolicy(learned_config({"score_rounds": 3, "score_every": 10,
                                           "lookup_rescore": False}), cost=_cost())
    asked = [g for g in range(40) if policy.choose([_generated("r", g)], DRAFTERS)[0].score]
    assert asked == [0, 4, 14, 24]  # the prompt's prefill, then rounds after 4 and every 10
    assert not policy.choose([_generated("r", 99)], DRAFTERS)[0].score
    policy.release("r")
    assert policy.choose([_generated("r", 50)], DRAFTERS)[0].score  # a new request is scored
    short = RequestView("s", 10, 0, policy.cfg.score_after, True)  # ends before a round
    assert policy.choose([short], DRAFTERS)[0].score == ()


def test_prompt_lookup_rescores_the_new_tokens_and_its_prior_follows_the_recent_ones() -> None:
    policy = LearnedPolicy(learned_config({"prompt_fit": False}), cost=_cost())
    (c,) = policy.choose([_generated("r", policy.cfg.score_after)], DRAFTERS)
    assert PROMPT_LOOKUP in c.score  # the first round
    observe_score(policy, "r", PROMPT_LOOKUP, 0, 8)  # the output does not repeat itself yet
    priors = []
    for g in range(policy.cfg.score_after + 1, policy.cfg.score_after + 7):
        plan = policy.choose([_generated("r", g)], {"draft-code", PROMPT_LOOKUP})
        (c,) = plan
        if c.drafter == PROMPT_LOOKUP:
            break
        assert c.score == (PROMPT_LOOKUP,)  # every step, while another drafter drafts
        # in the router, before the verification: which the step still calibrates
        assert plan.prediction is not None
        assert plan.prediction.scoring_work == (0, 0)
        observe(policy, "r", c, c.k, 0.004, 0.011)
        observe_score(policy, "r", PROMPT_LOOKUP, 4, 4)  # now it does: a loop
        priors.append(policy.controller.tracker.get("r", PROMPT_LOOKUP))
    assert len(priors) >= 2 and priors == sorted(priors)  # rounds ago weigh less and less
    assert c.drafter == PROMPT_LOOKUP  # the request moved to it


def test_a_plain_step_rewards_the_drafter_that_gave_it() -> None:
    policy = LearnedPolicy(cost=_cost())
    policy.selector.update("q", "draft-code", 5, 0.015)  # one good step: the scale
    before = policy.selector.snapshot("q")["draft-code"]
    (c,) = policy.choose([_generated("q", 1)], {"draft-code"})
    assert c.drafter == "draft-code"
    observe(policy, "q", StepChoice(None), 0, 0.0, 0.011)  # the step did not speculate
    mean, n = policy.selector.snapshot("q")["draft-code"]
    assert n == before[1] + 1 and mean < before[0]  # one token in 11 ms: a worse reward


def test_served_steps_calibrate_the_cost_model_but_not_a_verification_beside_scoring() -> None:
    policy = LearnedPolicy(cost=_cost())
    cal = policy.controller.calibration
    # predicted: 12 ms for the plain verification, 4 ms more for speculating, 4 ms of drafting;
    # served: the verification took 10 ms beyond the plain prediction, draft-code 6 ms
    pred = StepPrediction(0.02, {"draft-code": 0.004}, 0.016, plain_s=0.012)
    observe_step(policy, pred, {"draft-code": 0.006}, 0.022)
    assert (cal.plain, cal.marginal) == (1.0, pytest.approx(1 + 0.1 * (0.010 / 0.004 - 1)))
    assert cal.draft("draft-code") == pytest.approx(1 + 0.1 * 0.5)
    # draft-prose scored a request while the verifier ran, or a request prefilled: the
    # verification is not a clean sample (what the scoring added, 24 ms, is), the drafts are
    for extra in ({"scoring_work": (1, 12)}, {"prefill_tokens": 200}):
        observe_step(policy, replace(pred, **extra), {"draft-code": 0.006}, 0.040)
    assert cal.marginal == pytest.approx(1 + 0.1 * (0.010 / 0.004 - 1))
    assert cal.draft("draft-code") == pytest.approx((1 + 0.1 * 0.5) ** 3)
    assert policy.scoring_cost.steps == 1
    assert 0.010 < policy.scoring_cost.predict(1, 12) <= 0.024  # one step: toward 24 ms


def test_a_step_that_scores_predicts_what_the_scoring_adds_once_served_steps_showed_it() -> None:
    # unpriced: its steps measure speculation to save nothing, which would price the rounds (and
    # the drafters' catch-ups) out
    policy = LearnedPolicy(learned_config({"score_rounds": 3, "score_every": 12,
                                           "price_scoring": False, "price_catch_up": False}),
                           cost=_cost())

    def first_step(rid: str) -> StepPrediction:
        plan = policy.choose([RequestView(rid, 300, 0, 100, True)], DRAFTERS)
        (c,) = plan
        assert set(c.score) == {"draft-code", "draft-prose"}
        assert plan.prediction is not None
        return plan.prediction

    pred = first_step("a")
    assert pred.scoring_work == (2, 600)  # both drafters prefill the 300-token prompt
    assert pred.scoring_s == 0.0  # nothing learned yet
    for i in range(4):  # served: each such step took 30 ms more than its verification alone
        observe_step(policy, pred, {}, pred.verify_s + 0.030)
        policy.release("a")
        pred = first_step("a")
    assert pred.scoring_s == pytest.approx(0.030, rel=0.05)
    assert pred.step_s == pytest.approx(policy.controller.step_s(pred.draft_s, pred.verify_s)
                                        + pred.scoring_s)
    # later steps feed the scoring drafters only the tokens they have not seen
    observe_score(policy, "a", "draft-code", 60, 128)
    observe_score(policy, "a", "draft-prose", 55, 128)
    observe(policy, "a", StepChoice(PROMPT_LOOKUP, 4), 0, 0.0, 0.08)
    works = []
    for g in range(1, 40):
        plan = policy.choose([RequestView("a", 300 + g, g, 100 - g, True)], DRAFTERS)
        (c,) = plan
        assert plan.prediction is not None
        works.append((g, c.score, plan.prediction.scoring_work))
        observe(policy, "a", c, 0, 0.0, 0.011)
    # the output rounds (after 4 tokens, then every 12): a scoring drafter that is not drafting
    # is fed only the output since it last saw the request, never the prompt again
    # (a round's drafter that drafted in the step before has seen it all: nothing to feed)
    rounds = [(g, w) for g, s, w in works if set(s) & {"draft-code", "draft-prose"}]
    assert [g for g, _ in rounds] == [4, 16, 28]
    assert all(tokens <= calls * g for g, (calls, tokens) in rounds) and rounds[0][1][1] > 0


def test_a_request_has_state_from_first_sight_to_its_release() -> None:
    policy = LearnedPolicy(cost=_cost())
    policy.choose([_view("a"), _view("b", "off")], DRAFTERS)
    policy.release("b")
    observe_score(policy, "b", "draft-code", 3, 4)  # a report after its release: left out
    observe_score(policy, "never-seen", "draft-code", 3, 4)  # and one the policy never chose for
    assert len(policy._requests) == len(policy.selector._requests) == 1
    for rid in ("a", "b", "never-seen"):
        policy.release(rid)
    assert len(policy._requests) == len(policy.selector._requests) == 0


def test_arriving_prompts_are_scored_only_where_speculation_can_pay_for_it() -> None:
    """In a large batch where speculating measured to save little per token, the model drafters
    do not score arriving prompts (each call costs 40 ms, learnt in serving); alone, where it
    saves much, they do."""
    policy = LearnedPolicy(cost=_cost())
    for calls in (1, 2, 4, 8, 2):
        policy.scoring_cost.observe(calls, calls * 300, 0.040 * calls)
    big, solo = step_kind([True] * 32), step_kind([True])
    for _ in range(4):  # per token: 0.1 ms saved at batch 32, 10 ms alone
        policy.guard.observe(big, True, 40, 40 / 1100)
        policy.guard.observe(big, False, 32, 32 / 1000)
        policy.guard.observe(solo, True, 2, 2 / 50)
        policy.guard.observe(solo, False, 1, 1 / 33.3)
    crowd = [RequestView(f"r{i}", 300, 0, 64, True) for i in range(32)]
    assert all(c.score == () for c in policy.choose(crowd, DRAFTERS))
    plan = policy.choose([RequestView("alone", 300, 0, 64, True)], DRAFTERS)
    assert plan[0].score == ("draft-code", "draft-prose")
    assert plan.prediction is not None and plan.prediction.scoring_work == (2, 600)


def test_a_drafter_that_must_catch_up_drafts_only_where_speculation_can_pay_for_it() -> None:
    """Where speculating measured a loss, a request no longer starts drafting with a model
    drafter that has not seen its context (the catch-up costs 40 ms, learnt in serving); one
    that has seen it, prompt lookup and a head stay candidates; where it saves much, or before
    anything is measured, every drafter may draft."""
    policy = LearnedPolicy(learned_config({"prompt_fit": False}), cost=_cost())
    policy.heads = heads = frozenset({"eagle"})
    everyone, solo = DRAFTERS | heads, step_kind([False])

    def candidates(rid: str) -> set[str]:
        view = RequestView(rid, 300, 1, 64, False)
        saving = policy.guard.saving(solo)
        return policy._drafters([view], [policy._begin(view)], everyone, saving)[0][rid]

    try:
        assert candidates("unmeasured") == everyone  # nothing measured: all explored
        for calls in (1, 2, 4):
            policy.scoring_cost.observe(calls, calls * 300, 0.040 * calls)
        for _ in range(4):  # speculating alone: 2 tokens in 40 ms against 1 in 15 ms
            policy.guard.observe(solo, True, 2, 0.040)
            policy.guard.observe(solo, False, 1, 0.015)
        assert policy.guard.saving(solo) < 0
        assert candidates("at-a-loss") == {PROMPT_LOOKUP, "eagle"}
        policy._begin(RequestView("held", 300, 1, 64, False)).fed["draft-code"] = 300  # seen
        assert candidates("held") == {"draft-code", PROMPT_LOOKUP, "eagle"}
        for _ in range(40):  # now speculating alone: 3 tokens in 20 ms
            policy.guard.observe(solo, True, 3, 0.020)
        assert 64 * policy.guard.saving(solo) > policy.scoring_cost.predict(1, 300)
        assert candidates("paying") == everyone
        policy.cfg.price_catch_up = False
        for _ in range(40):
            policy.guard.observe(solo, True, 2, 0.040)
        assert candidates("unpriced") == everyone
    finally:
        policy.close()


def test_a_draft_head_is_every_requests_candidate_and_never_scores() -> None:
    """A head scores no prompt: it stays a candidate beside the fitted model, is tried, and is
    never asked to score; given acceptance it is chosen with k > 0."""
    cost = _cost()
    cost.draft["eagle"] = (0.0, 0.0005, 0.0, 0.0, 0.0)
    pop = {"draft-code": _stats(100, 200), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 60)}
    policy = LearnedPolicy(cost=cost, population=lambda: pop)
    heads = frozenset({"eagle"})
    available = DRAFTERS | heads
    try:
        (c,) = policy.choose([_generated("p", 0)], available, heads)
        assert "eagle" not in c.score and set(c.score) == {"draft-code", "draft-prose"}
        observe_score(policy, "p", "draft-prose", 60, 128)
        observe_score(policy, "p", "draft-code", 20, 128)
        observe(policy, "p", c, 0, 0.0, 0.080)
        chosen = set()
        for g in range(1, 40):
            (c,) = policy.choose([_generated("p", g)], available, heads)
            assert "eagle" not in c.score
            chosen.add(c.drafter)
            eagle = c.drafter == "eagle"
            observe(policy, "p", c, c.k if eagle else 0, 0.002 if eagle else 0.004, 0.011)
        assert "eagle" in chosen and chosen <= {"eagle", "draft-prose", PROMPT_LOOKUP, None}
        assert policy.selector.snapshot("p")["eagle"][1] > 0  # its steps were its own measure
    finally:
        policy.close()


def test_priors_are_the_populations_measure_moved_by_the_requests_evidence() -> None:
    """Once a request's prompt is fitted, every arm's prior is on the population's measured
    scale: the head's is its measured goodput (no evidence of its own on this request), and the
    fitted model's is its measured goodput times the cost model's goodput at its expected
    acceptance over that at its population acceptance; not the prediction alone, which leaves
    out the router's and the services' overheads (a different share for each drafter)."""
    cost = _cost()
    cost.draft["eagle"] = (0.0, 0.0005, 0.0, 0.0, 0.0)
    eagle = DrafterStats(drafts=100, draft_tokens=400, accepted_tokens=210, rejections=90,
                         draft_seconds=0.1, verify_seconds=9.9)  # measured: 31 tokens/s
    pop = {"draft-code": _stats(100, 200), "draft-prose": _stats(100, 200),
           PROMPT_LOOKUP: _stats(100, 60), "eagle": eagle}
    policy = LearnedPolicy(cost=cost, population=lambda: pop)
    heads = frozenset({"eagle"})
    try:
        (c,) = policy.choose([_generated("p", 0)], DRAFTERS | heads, heads)
        observe_score(policy, "p", "draft-prose", 60, 128)
        observe_score(policy, "p", "draft-code", 20, 128)
        observe(policy, "p", c, 0, 0.0, 0.080)
        policy.fit._trials["draft-prose"] = [90.0, 10.0]  # it fitted earlier requests: 0.9
        policy.choose([_generated("p", 1)], DRAFTERS | heads, heads)
        snap = policy.selector.snapshot("p")
        assert policy.controller.tracker.get("p", "eagle") == pytest.approx(0.7)  # 210 / 300
        assert snap["eagle"][0] == pytest.approx(31.0)
        assert policy.controller.solo_goodput("p", "eagle", 0.7, 201) > 100  # the prediction
        measured = (100 + 200) / (100 * 0.015)  # draft-prose: 200 tokens/s
        pop_rate = policy.controller.tracker.prior("draft-prose", "p")
        ratio = (policy.controller.solo_goodput("p", "draft-prose", 0.9, 201)
                 / policy.controller.solo_goodput("p", "draft-prose", pop_rate, 201))
        assert ratio > 1.2 and snap["draft-prose"][0] == pytest.approx(measured * ratio)
    finally:
        policy.close()


@pytest.mark.parametrize("drafter", ["draft-code", "eagle"])
def test_a_held_request_probes_its_drafter_with_k_1(drafter: str) -> None:
    """Held at k = 0, a request probes its drafter with k = 1 every ``probe_every`` steps: a
    model drafter's probe is verified in its step. A head's would draft a chain in its step
    (which verifies nothing: ``asked``) for the next one to verify: a turn to the head, priced
    over those two steps (``HeadChains.transitions``), which at 0.1 a token never pays."""
    cost = _cost()
    cost.draft["eagle"] = (0.0, 0.001, 0.0, 0.0, 0.0)
    pop = {drafter: _stats(100, 10)}  # accepts 0.1 a token: the controller holds k = 0
    policy = LearnedPolicy(learned_config({"score_after": 0, "probe_every": 4}), cost,
                           population=lambda: pop)
    heads = frozenset({"eagle"} & {drafter})
    try:
        ks, verified = [], []
        for g in range(1, 20):
            (c,) = policy.choose([_generated("p", g)], {drafter}, heads)
            ks.append(c.k)
            if heads and c.k and c.ask is None:  # the head's probe: it drafts, verifies none
                policy.observe(StepOutcome((RequestOutcome("p", True, StepChoice(None),
                                                           verified=True, emitted=1,
                                                           asked=True),)))
                continue
            verified.append(c)
            observe(policy, "p", c, 0, 0.001 if c.k else 0.0, 0.010)
        if heads:
            assert ks == [0] * len(ks)
            return
        assert max(ks) == 1 and ks.count(1) >= 3
        probes = [c for c in verified if c.k]
        assert probes and all(c.drafter == drafter and c.k == 1 for c in probes)
        assert all(c.ask is None for c in probes)
    finally:
        policy.close()


def test_a_plain_plan_holds_and_each_held_forward_counts_toward_the_k_1_probe() -> None:
    """Where the controller gives every request k = 0 after its first step, the plan holds
    (``StepPlan.hold``: as many forwards as the scheduler runs), not on the first step (its
    prefill); each forward of a held call counts toward the k = 1 probe (``probe_every``), so
    the probes come every ``probe_every`` forwards however many a call runs (counted a call at
    a time, 4 forwards a call probed once in 60 forwards)."""
    pop = {"draft-code": _stats(100, 10)}  # accepts 0.1 a token: the controller holds k = 0
    policy = LearnedPolicy(learned_config({"score_after": 0, "probe_every": 8}), _cost(),
                           population=lambda: pop)
    try:
        first = policy.choose([_generated("p", 0)], {"draft-code"})
        assert first[0].k == 0 and first.hold == 1
        observe(policy, "p", first[0], 0, 0.0, 0.010)
        g, probes = 1, []
        while g < 60:
            plan = policy.choose([_generated("p", g)], {"draft-code"})
            if plan[0].k:
                probes.append(g)
                observe(policy, "p", plan[0], 0, 0.001, 0.010)
                g += 1
                continue
            assert plan.hold > 4
            held = RequestOutcome("p", True, StepChoice(None), 0, 0, 4, True)
            policy.observe(StepOutcome((held,), None, 0.0, 0.04, 0.04, forwards=4))
            g += 4
        gaps = [b - a for a, b in zip(probes, probes[1:])]
        assert len(probes) >= 4 and max(gaps) <= 8 + 1, probes
    finally:
        policy.close()


def test_the_guards_plain_steps_do_not_count_toward_the_k_1_probe(monkeypatch) -> None:
    """The k = 1 probe is for a request the controller holds at k = 0: steps and held forwards
    the loss guard ran plain do not count toward it, so the guard's probe of speculation runs
    the controller's plan (counted, 23 requests of a batch of 32 probed at once with k = 1 on
    drafters that had to catch up with whole contexts: a 0.39 s step where a plain forward took
    0.07 s, ``spin bench grid --split tuning --concurrency 32``)."""
    without_guard(monkeypatch)
    pop = {"draft-code": _stats(100, 10)}  # accepts 0.1 a token: the controller holds k = 0
    policy = LearnedPolicy(learned_config({"score_after": 0, "probe_every": 4}), _cost(),
                           population=lambda: pop)
    guard_plain = [True]
    monkeypatch.setattr(policy.guard, "plain", lambda reqs: guard_plain * len(reqs))
    try:
        g = 0
        for _ in range(10):  # the guard's held calls of 4 forwards
            (c,) = policy.choose([_generated("p", g)], {"draft-code"})
            assert c.drafter is None and c.k == 0
            held = RequestOutcome("p", True, StepChoice(None), 0, 0, 4, True)
            policy.observe(StepOutcome((held,), None, 0.0, 0.04, 0.04, forwards=4))
            g += 4
        guard_plain[0] = False  # the guard's probe of speculation, then speculation decided
        ks = []
        for _ in range(6):
            (c,) = policy.choose([_generated("p", g)], {"draft-code"})
            ks.append(c.k)
            observe(policy, "p", c, 0, 0.001 if c.k else 0.0, 0.010)
            g += 1
        assert ks[:4] == [0, 0, 0, 0] and 1 in ks[4:], ks  # the controller's k = 0, 4 times
    finally:
        policy.close()


def test_a_heads_chain_is_verified_when_the_controller_stops_drafting(monkeypatch) -> None:
    """The chain a head drafted for a request's coming step is verified even where the
    controller gives the request k = 0 (``StepChoice.ask`` = 0: no new chain), then the request
    runs plain; a step that was not verified holds no chain."""
    without_guard(monkeypatch)
    cost = _cost()
    cost.draft["eagle"] = (0.0, 0.001, 0.0, 0.0, 0.0)
    pop = {"eagle": _stats(100, 350)}  # accepts ~0.88 a token
    policy = LearnedPolicy(learned_config({"score_after": 0, "probe_every": 100}), cost,
                           population=lambda: pop)
    heads = frozenset({"eagle"})
    try:
        (c,) = policy.choose([_generated("p", 1)], {"eagle"}, heads)
        assert c.drafter == "eagle" and c.k > 0 and c.ask is None
        seen = []
        for g in range(2, 30):  # every draft rejected: the estimate falls to k = 0
            observe(policy, "p", c, 0, 0.001, 0.010)
            (c,) = policy.choose([_generated("p", g)], {"eagle"}, heads)
            seen.append(c)
            if c.ask == 0:
                break
        last = seen[-2] if len(seen) > 1 else None
        assert c.drafter == "eagle" and c.ask == 0 and last is not None and c.k == last.k
        observe(policy, "p", c, 0, 0.0, 0.012)
        (c,) = policy.choose([_generated("p", 40)], {"eagle"}, heads)
        assert c.drafter is None  # nothing held any more
        chains = policy.head_chains
        chains.planned([_generated("q", 1)], [StepChoice("eagle", 3)], heads)
        chains.verified("q", False)  # preempted, failed: no chain held
        assert chains.verify_held([_generated("q", 2)], [None], [0], {"eagle"},
                                  policy.controller) == [None]
        chains.planned([_generated("q", 2)], [StepChoice("eagle", 3)], heads)
        chains.verified("q", True)  # (the same step verified: held)
        assert chains.verify_held([_generated("q", 3)], [None], [0], {"eagle"},
                                  policy.controller) == [0]
    finally:
        policy.close()


def test_a_held_chain_is_verified_only_where_the_cost_model_says_it_pays() -> None:
    """Alone, a held chain's extra rows cost less than the tokens they are expected to give; in
    a batch of 32 plain requests whose every scored token costs 4 ms, four more rows cost more
    than the ~1.3 tokens they give. Without a cost model it is verified."""
    pop = {"eagle": _stats(100, 250)}
    for per_token, batch, verified in [(1e-4, 1, True), (0.004, 32, False)]:
        policy = LearnedPolicy(cost=_cost(per_token), population=lambda: pop)
        try:
            views = [_generated(f"r{i}", 5) for i in range(batch)]
            for v in views:
                policy.controller.tracker.begin(v.request_id, True)
            assert pays(views, [None] * batch, [0] * batch, {0: ("eagle", 4)},
                        policy.controller) is verified
        finally:
            policy.close()
    bare = LearnedPolicy()
    assert pays([_generated("r", 5)], [None], [0], {0: ("eagle", 4)}, bare.controller)


def _turning(rate: float, held: bool = False, prefill: int = 0) -> list[int]:
    """The k a lone greedy request keeps turning to the head "eagle" at k = 4 with acceptance
    ``rate`` (``HeadChains.transitions``); ``held``: it holds the head's chain already."""
    cost = _cost()
    cost.draft["eagle"] = (0.0, 0.001, 0.0, 0.0, 0.0)
    controller = SpecLengthController(cost)
    controller.tracker.set_population({"eagle": rate})
    view = _generated("p", 0 if prefill else 5)
    chains = HeadChains()
    if held:
        chains.planned([view], [StepChoice("eagle", 4)], frozenset({"eagle"}))
        chains.verified("p", True)
    ks = [4]
    chains.transitions([view], ["eagle"], ks, frozenset({"eagle"}), controller, prefill)
    return ks


def test_a_turn_to_a_head_is_priced_over_the_two_steps_it_takes() -> None:
    """A request's first step with a head gives one token (its chain is verified the next):
    the turn keeps its k only where the two steps give more tokens a second than two plain
    ones. A 10 ms verification, 1 ms a head level: at 0.88 a token (E = 4.1) 5.1 tokens in
    29 ms against 2 in 20; at 0.3 (E = 1.4) 2.4 in 29 ms does not pay, but beside a prompt of
    2000 tokens (200 ms either way) it does; a request holding the chain is no turn."""
    assert _turning(0.88) == [4]
    assert _turning(0.3) == [0]
    assert _turning(0.3, prefill=2000) == [4]
    assert _turning(0.3, held=True) == [4]


def test_a_held_chain_is_verified_whatever_the_bandit_picks() -> None:
    """A request holding a head's chain whose bandit picks another drafter verifies the chain
    and asks for none (the pick drafts from the next step): the chain is never dropped for
    another drafter's draft. A request in mode drafter keeps its own drafter."""
    chains = HeadChains()
    heads = frozenset({"eagle"})
    views = [_generated(r, 5) for r in ("a", "b", "c")]
    views[2] = replace(views[2], mode="drafter", drafter="draft-code")
    chains.planned(views, [StepChoice("eagle", 4)] * 3, heads)
    for v in views:
        chains.verified(v.request_id, True)
    drafters: list[str | None] = [PROMPT_LOOKUP, "eagle", "draft-code"]
    chains.keep(views, drafters, {"eagle", PROMPT_LOOKUP, "draft-code"})
    assert drafters == [None, "eagle", "draft-code"]
    assert chains.verify_held(views, drafters, [0, 4, 4], {"eagle"},
                              SpecLengthController()) == [0, None, None]
    assert drafters[0] == "eagle"
    drafters = [PROMPT_LOOKUP] * 3
    chains.keep(views, drafters, {PROMPT_LOOKUP})  # the head is down: its chain is not held
    assert drafters == [PROMPT_LOOKUP] * 3
