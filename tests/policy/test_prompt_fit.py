"""The prompt fit: ranking drafters by prompt agreement, and how best-fit drafters did."""

from __future__ import annotations

from spin.policy.prompt_fit import PromptFit


def test_the_best_fit_needs_two_scores_and_the_margin() -> None:
    fit = PromptFit(min_margin=0.1)
    fit.observe_prompt("r", "draft-code", 30, 100)
    assert fit.best("r") is None  # one drafter: nothing to rank
    fit.observe_prompt("r", "draft-prose", 35, 100)
    assert fit.best("r") is None  # 0.35 vs 0.30: within the margin
    fit.observe_prompt("r", "draft-structured", 70, 100)
    assert fit.best("r") == "draft-structured"
    fit.observe_prompt("r", "draft-general", 0, 0)  # nothing scored: ignored
    assert fit.best("r") == "draft-structured"
    fit.release("r")
    assert fit.best("r") is None


def test_acceptance_counts_only_best_fit_requests() -> None:
    fit = PromptFit(min_trials=8)
    for rid, code, prose in (("a", 60, 10), ("b", 10, 60)):
        fit.observe_prompt(rid, "draft-code", code, 100)
        fit.observe_prompt(rid, "draft-prose", prose, 100)
    fit.record("a", "draft-code", 4, 0)
    assert fit.acceptance("draft-code") is None  # 4 draft tokens: too few
    fit.record("a", "draft-code", 3, 1)
    fit.record("b", "draft-code", 0, 1)  # b fits draft-prose: not counted for draft-code
    fit.record("a", "draft-prose", 0, 1)  # a fits draft-code: not counted for draft-prose
    assert fit.acceptance("draft-code") == 7 / 8
    assert fit.acceptance("draft-prose") is None
