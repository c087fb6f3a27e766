"""The prompt fit: ranking drafters by prompt agreement, and how best-fit drafters did."""

from __future__ import annotations

from spin.policy.prompt_fit import PromptFit


def test_the_fitting_drafters_need_two_scores_and_take_those_within_the_margin() -> None:
    fit = PromptFit(margin=0.1, rank_margin=0.0)
    fit.observe_prompt("r", "draft-code", 30, 100)
    assert fit.fitting("r") == ()  # one drafter: nothing to rank
    fit.observe_prompt("r", "draft-prose", 35, 100)
    assert fit.fitting("r") == ("draft-prose", "draft-code")  # 0.30 is within 0.1 of 0.35
    fit.observe_prompt("r", "draft-structured", 70, 100)
    assert fit.fitting("r") == ("draft-structured",)
    fit.observe_prompt("r", "draft-general", 0, 0)  # nothing scored: ignored
    fit.observe_prompt("r", "draft-general", 65, 100)
    assert fit.fitting("r") == ("draft-structured", "draft-general")
    assert PromptFit().fitting("r") == ()  # per instance
    fit.release("r")
    assert fit.fitting("r") == ()


def _a_fits_code_b_fits_prose() -> PromptFit:
    fit = PromptFit(min_trials=8)
    for rid, code, prose in (("a", 60, 10), ("b", 10, 60)):
        fit.observe_prompt(rid, "draft-code", code, 100)
        fit.observe_prompt(rid, "draft-prose", prose, 100)
    return fit


def test_acceptance_counts_only_best_fit_requests() -> None:
    fit = _a_fits_code_b_fits_prose()
    fit.record("a", "draft-code", 4, 0)
    assert fit.acceptance("draft-code") is None  # 4 draft tokens: too few
    fit.record("a", "draft-code", 3, 1)
    fit.record("b", "draft-code", 0, 1)  # b fits draft-prose: not counted for draft-code
    fit.record("a", "draft-prose", 0, 1)  # a fits draft-code: not counted for draft-prose
    assert fit.acceptance("draft-code") == 7 / 8
    assert fit.acceptance("draft-prose") is None


def test_the_pooled_record_counts_every_drafter_on_the_requests_it_fitted() -> None:
    fit = _a_fits_code_b_fits_prose()
    fit.record("a", "draft-code", 3, 1)
    assert fit.pooled_acceptance() is None  # 4 draft tokens: too few
    fit.record("b", "draft-prose", 4, 0)
    fit.record("b", "draft-code", 0, 4)  # b fits draft-prose: not counted
    assert fit.acceptance("draft-code") is None and fit.acceptance("draft-prose") is None
    assert fit.pooled_acceptance() == 7 / 8


def test_greedy_and_sampling_requests_keep_separate_records() -> None:
    """A sampled draft is accepted less than a greedy one: a sampling request is ranked and
    seeded by what the drafter did on the sampling requests it fitted, never the greedy ones."""
    fit = _a_fits_code_b_fits_prose()
    for rid, code in (("s", 60), ("g", 60)):
        fit.observe_prompt(rid, "draft-code", code, 100)
        fit.observe_prompt(rid, "draft-prose", 10, 100)
    fit.begin("s", greedy=False)
    fit.begin("g", greedy=True)
    fit.record("g", "draft-code", 8, 0)
    fit.record("s", "draft-code", 2, 6)
    assert fit.acceptance("draft-code", "g") == 1.0 and fit.acceptance("draft-code") == 1.0
    assert fit.acceptance("draft-code", "s") == 2 / 8
    assert fit.pooled_acceptance("s") == 2 / 8 and fit.pooled_acceptance("g") == 1.0
    fit.release("s")  # forgotten: a later request of that id counts as greedy
    assert fit.acceptance("draft-code", "s") == 1.0


def test_near_ties_go_to_the_drafter_with_the_better_record() -> None:
    fit = PromptFit(min_trials=8, rank_margin=0.02)
    fit.observe_prompt("a", "draft-general", 62, 100)
    fit.observe_prompt("a", "draft-structured", 60, 100)
    assert fit.fitting("a") == ("draft-general",)  # no records: the better agreement
    fit.record("a", "draft-general", 5, 5)  # it accepted half on a's output
    fit.observe_prompt("b", "draft-general", 62, 100)
    fit.observe_prompt("b", "draft-structured", 60, 100)
    assert fit.fitting("b") == ("draft-structured",)  # untried beats a record of 0.5
    fit.record("b", "draft-structured", 9, 1)
    fit.observe_prompt("c", "draft-general", 70, 100)
    fit.observe_prompt("c", "draft-structured", 60, 100)
    assert fit.fitting("c") == ("draft-general",)  # 0.10 apart: agreement decides


def test_the_expected_acceptance_is_the_record_less_the_agreement_deficit() -> None:
    fit = PromptFit(min_trials=8, deficit_weight=3.0)  # every drafter ranked (rank_margin 1)
    fit.observe_prompt("a", "draft-code", 30, 100)
    fit.observe_prompt("a", "draft-prose", 25, 100)
    assert fit.fitting("a") == ("draft-code",)  # no records: 1.0 against 1.0 - 3 x 0.05
    fit.record("a", "draft-code", 4, 4)  # it accepted half on a's output
    fit.observe_prompt("b", "draft-code", 30, 100)
    fit.observe_prompt("b", "draft-prose", 25, 100)
    assert fit.fitting("b") == ("draft-prose",)  # 0.5 against 0.85
    fit.observe_prompt("c", "draft-code", 30, 100)
    fit.observe_prompt("c", "draft-prose", 10, 100)
    assert fit.fitting("c") == ("draft-code",)  # 0.5 against 1.0 - 3 x 0.2 = 0.4
    flat = PromptFit(min_trials=8, deficit_weight=0.0)  # by record alone
    flat.observe_prompt("d", "draft-code", 30, 100)
    flat.observe_prompt("d", "draft-prose", 5, 100)
    assert flat.fitting("d") == ("draft-code",)  # both untried: the agreement breaks the tie
    flat.record("d", "draft-code", 4, 4)
    flat.observe_prompt("e", "draft-code", 30, 100)
    flat.observe_prompt("e", "draft-prose", 5, 100)
    assert flat.fitting("e") == ("draft-prose",)  # untried (1.0) beats 0.5, however far behind


def test_value_ranks_a_cheap_drafter_above_a_costly_one_that_predicts_a_little_better() -> None:
    calls: list[tuple[str, str, float]] = []

    def value(request_id: str, drafter: str, rate: float) -> float:
        calls.append((request_id, drafter, rate))
        return rate / (4.0 if drafter == "draft-general" else 1.0)  # four times the cost

    fit = PromptFit(min_trials=8, value=value)
    fit.observe_prompt("a", "draft-general", 62, 100)
    fit.observe_prompt("a", "draft-structured", 60, 100)
    assert fit.fitting("a") == ("draft-structured",)  # 0.94 against 1.0 / 4
    assert ("a", "draft-structured", 1.0 - 3.0 * 0.02) in [(r, d, round(x, 9)) for r, d, x in calls]
    alone = PromptFit(min_trials=8)
    alone.observe_prompt("a", "draft-general", 62, 100)
    alone.observe_prompt("a", "draft-structured", 60, 100)
    assert alone.fitting("a") == ("draft-general",)


def _fitted(fit: PromptFit, rid: str, scores: dict[str, int]) -> None:
    """A request whose prompt ``scores`` drafters scored (agreement in %), then released."""
    for name, pct in scores.items():
        fit.observe_prompt(rid, name, pct, 100)
    fit.release(rid)


def test_a_drafter_that_never_fits_scores_only_now_and_then_until_it_fits_again() -> None:
    fit = PromptFit(prune_after=3, explore_every=4, rank_margin=0.0)
    names = ("draft-code", "draft-general", "draft-prose")
    assert fit.worth_scoring(names) == names  # prompt 1: no record yet
    for i in range(3):  # draft-general comes second every time
        _fitted(fit, f"r{i}", {"draft-code": 60 - 40 * (i % 2), "draft-general": 41,
                               "draft-prose": 20 + 40 * (i % 2)})
    assert fit.worth_scoring(names) == ("draft-code", "draft-prose")  # prompt 2
    assert fit.worth_scoring(names) == ("draft-code", "draft-prose")  # prompt 3
    assert fit.worth_scoring(names) == names  # prompt 4: explores
    _fitted(fit, "g", {"draft-code": 10, "draft-general": 70, "draft-prose": 20})
    assert fit.worth_scoring(names) == names  # it fitted one of its last 3


def test_pruning_keeps_two_scorers_and_can_be_off() -> None:
    fit = PromptFit(prune_after=2, explore_every=0, rank_margin=0.0)
    for i in range(2):  # draft-code always fits: both others lose twice
        _fitted(fit, f"r{i}", {"draft-code": 90, "draft-general": 40, "draft-prose": 30})
    assert fit.worth_scoring(("draft-code", "draft-general", "draft-prose")) == (
        "draft-code", "draft-general", "draft-prose")  # only one would be left
    assert fit.worth_scoring(("draft-code", "draft-general", "draft-prose", "draft-x")) == (
        "draft-code", "draft-x")
    off = PromptFit(prune_after=0)
    for i in range(3):
        _fitted(off, f"r{i}", {"draft-code": 90, "draft-general": 40, "draft-prose": 30})
    assert off.worth_scoring(("draft-prose", "draft-code")) == ("draft-code", "draft-prose")
