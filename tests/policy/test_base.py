"""FixedPolicy: one drafter and k for every request, with per-request overrides and fallback."""

from __future__ import annotations

from spin.policy import FixedPolicy, RequestView, StepChoice
from spin.policy.base import PROMPT_LOOKUP
from spin.policy.outcome import RequestOutcome, StepOutcome

ALL = {PROMPT_LOOKUP, "draft-code", "draft-prose"}


def _view(rid: str = "r", remaining: int = 100, **kw) -> RequestView:
    return RequestView(request_id=rid, context_len=10, generated=0, remaining=remaining,
                       greedy=True, **kw)


def test_defaults() -> None:
    p = FixedPolicy()
    assert (p.drafter, p.k, p.fallback) == (PROMPT_LOOKUP, 4, PROMPT_LOOKUP)
    assert p.choose([_view()], ALL) == [StepChoice(PROMPT_LOOKUP, 4)]
    assert p.choose([], ALL) == []


def test_auto_uses_policy_drafter_and_k() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    out = p.choose([_view("a"), _view("b", k=7)], ALL)  # k of a non-'drafter' mode is ignored
    assert out == [StepChoice("draft-code", 3), StepChoice("draft-code", 3)]
    assert out[0].branching == ()


def test_mode_off_never_speculates() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    out = p.choose([_view(mode="off"), _view(mode="off", drafter="draft-prose", k=5)], ALL)
    assert out == [StepChoice(None), StepChoice(None)]
    assert all(c.k == 0 and c.drafter is None for c in out)


def test_mode_drafter_with_own_k() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    out = p.choose([_view(mode="drafter", drafter="draft-prose", k=6)], ALL)
    assert out == [StepChoice("draft-prose", 6)]


def test_mode_drafter_with_k_zero_uses_policy_k() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    assert p.choose([_view(mode="drafter", drafter="draft-prose", k=0)], ALL) == \
        [StepChoice("draft-prose", 3)]


def test_mode_drafter_without_drafter_does_not_speculate() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    assert p.choose([_view(mode="drafter", drafter=None, k=5)], ALL) == [StepChoice(None)]


def test_unavailable_drafter_falls_back_to_prompt_lookup() -> None:
    p = FixedPolicy(drafter="draft-code", k=3)
    avail = {PROMPT_LOOKUP, "draft-code"}
    out = p.choose([_view("a", mode="drafter", drafter="draft-prose", k=5), _view("b")], avail)
    assert out == [StepChoice(PROMPT_LOOKUP, 5), StepChoice("draft-code", 3)]
    # the policy's own default drafter down: fallback with the policy's k
    assert p.choose([_view()], {PROMPT_LOOKUP}) == [StepChoice(PROMPT_LOOKUP, 3)]


def test_no_fallback_means_no_speculation() -> None:
    p = FixedPolicy(drafter="draft-code", k=3, fallback=None)
    assert p.choose([_view(), _view(mode="drafter", drafter="draft-prose", k=2)], {PROMPT_LOOKUP}) \
        == [StepChoice(None), StepChoice(None)]


def test_fallback_also_unavailable_means_no_speculation() -> None:
    p = FixedPolicy(drafter="draft-code", k=3, fallback="draft-prose")
    assert p.choose([_view()], {PROMPT_LOOKUP}) == [StepChoice(None)]
    assert p.choose([_view()], set()) == [StepChoice(None)]
    assert p.choose([_view()], {"draft-prose"}) == [StepChoice("draft-prose", 3)]


def test_k_clipped_to_remaining_minus_one() -> None:
    p = FixedPolicy(k=4)
    views = [_view("a", remaining=10), _view("b", remaining=5), _view("c", remaining=4),
             _view("d", remaining=3), _view("e", remaining=2), _view("f", remaining=1),
             _view("g", remaining=0)]
    out = p.choose(views, ALL)
    assert [c.k for c in out] == [4, 4, 3, 2, 1, 0, 0]
    assert [c.drafter for c in out] == [PROMPT_LOOKUP] * 5 + [None, None]
    own = p.choose([_view(mode="drafter", drafter="draft-code", k=9, remaining=3)], ALL)
    assert own == [StepChoice("draft-code", 2)]


def test_default_drafter_none_does_not_speculate_unless_asked() -> None:
    p = FixedPolicy(drafter=None, k=5)
    out = p.choose([_view("a"), _view("b", mode="drafter", drafter="draft-code")], ALL)
    assert out == [StepChoice(None), StepChoice("draft-code", 5)]


def test_policy_k_zero_does_not_speculate() -> None:
    assert FixedPolicy(k=0).choose([_view()], ALL) == [StepChoice(None)]


def test_observe_and_release_are_no_ops() -> None:
    p = FixedPolicy(drafter="draft-code", k=2)
    choice = StepChoice("draft-code", 2)
    step = StepOutcome((RequestOutcome("r", True, choice, 2, 2, 3, True),), None, 0.01, 0.02,
                       0.03)
    assert p.observe(step) is None
    assert p.release("r") is None
    assert p.choose([_view("r")], ALL) == [choice]  # stateless
