"""What the scheduler reports to a policy, built by hand: one ``StepOutcome`` per call.

The policy tests speak of one request's step, one drafter's score or one step's times; each
helper wraps it in the step record the router hands ``Policy.observe`` (``policy/outcome.py``).
"""

from __future__ import annotations

from spin.policy.base import Policy, StepChoice, StepPrediction
from spin.policy.outcome import RequestOutcome, Score, StepOutcome, TreeOutcome


def observe(policy: Policy, request_id: str, choice: StepChoice, accepted: int,
            draft_s: float, verify_s: float, ranks: TreeOutcome | None = None) -> None:
    """One verified step of one request: ``accepted`` of its draft, what it waited for each."""
    drafted = choice.k if choice.drafter else 0
    r = RequestOutcome(request_id, True, choice, drafted, accepted, accepted + 1, True, ranks)
    policy.observe(StepOutcome((r,), None, draft_s, verify_s, draft_s + verify_s))


def observe_score(policy: Policy, request_id: str, drafter: str, matches: int, positions: int,
                  accepted: float | None = None) -> None:
    """``drafter`` scored the request (no step of it verified)."""
    r = RequestOutcome(request_id, True, StepChoice(None),
                       scores=(Score(drafter, matches, positions, accepted),))
    policy.observe(StepOutcome((r,)))


def observe_step(policy: Policy, prediction: StepPrediction, draft_s: dict[str, float],
                 verify_s: float) -> None:
    """A step the policy predicted took ``draft_s`` per drafter call and ``verify_s`` for the
    rest (no request verified in it)."""
    policy.observe(StepOutcome((), prediction, max(draft_s.values(), default=0.0), verify_s,
                               max(draft_s.values(), default=0.0) + verify_s, draft_s))


def without_guard(monkeypatch) -> None:
    """Build learned policies without the loss guard from here on: a test that pins the policy's
    choices step by step would otherwise see the guard's probes of plain steps (the guard has
    tests of its own, ``test_loss_guard.py``, and a replay scenario)."""
    from dataclasses import replace

    from spin.policy import learned
    from spin.policy.loss_guard import LossGuard

    monkeypatch.setattr(learned, "LossGuard", lambda cfg: LossGuard(replace(cfg, enabled=False)))


def timed_step(spec: bool, batch: int = 3, greedy: bool = False) -> StepOutcome:
    """A step of ``batch`` requests: speculating (k = 2, 1 accepted: 2 tokens each, 0.25 s
    measured, 0.2 s predicted against 0.1 s plain, 5 tokens expected) or plain (1 token each,
    0.1 s measured and predicted)."""
    reqs = tuple(RequestOutcome(f"r{j}", greedy, StepChoice("d" if spec else None, 2 * spec),
                                2 * spec, int(spec), 1 + spec, True) for j in range(batch))
    pred = StepPrediction(0.2 if spec else 0.1, {"d": 0.05} if spec else {}, 0.15 if spec else 0.1,
                          plain_s=0.1, tokens=5.0 if spec else float(batch))
    return StepOutcome(reqs, pred, 0.05 * spec, 0.1, 0.25 if spec else 0.1,
                       {"d": 0.05} if spec else {}, 0.14 if spec else 0.09)
