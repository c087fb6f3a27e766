"""The draft-head proposer: a step proposes the chain the head drafted with the last verdict,
asks for the next, and never proposes a chain drafted for another context."""

from __future__ import annotations

import asyncio

from spin.engine.head_runner import HeadAsk
from spin.engine.sampling import SamplingParams
from spin.policy.base import StepChoice
from spin.router.proposers import DraftHead
from spin.router.requests import RequestParams, RouterRequest
from spin.router.services import VerifyResult


def _request() -> RouterRequest:
    return RouterRequest(RequestParams("r", prompt=(1, 2, 3), max_tokens=20,
                                       sampling=SamplingParams()))


def test_a_step_proposes_the_chain_drafted_with_the_last_verdict() -> None:
    head, r = DraftHead("h", lambda: True), _request()
    first = asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    assert first.trees == {} and first.asks == {"r": HeadAsk("h", k=3, stored=0)}
    head.verified({"r": VerifyResult("r", [9], 0, head_draft=[5, 6, 7])})
    r.generated.append(9)
    second = asyncio.run(head.propose([(r, StepChoice("h", 2))], 1.0))
    assert second.trees["r"].tokens == (5, 6) and second.trees["r"].is_chain
    assert second.asks["r"] == HeadAsk("h", k=2, stored=2)
    assert second.seconds == 0.0 and not second.remote


def test_a_step_asking_for_none_verifies_the_chain_and_drafts_no_more() -> None:
    """``StepChoice.ask`` = 0 (the policy's k = 0 for a request holding a chain): the chain is
    proposed, the head asked for nothing, so the step after it has no chain."""
    head, r = DraftHead("h", lambda: True), _request()
    asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    head.verified({"r": VerifyResult("r", [9], 0, head_draft=[5, 6, 7])})
    r.generated.append(9)
    last = asyncio.run(head.propose([(r, StepChoice("h", 3, ask=0))], 1.0))
    assert last.trees["r"].tokens == (5, 6, 7) and last.asks["r"] == HeadAsk("h", k=0, stored=3)
    head.verified({"r": VerifyResult("r", [5, 8], 1)})  # no draft came back
    r.generated.extend([5, 8])
    after = asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    assert after.trees == {} and after.asks["r"].stored == 0


def test_a_chain_for_another_context_is_not_proposed() -> None:
    head, r = DraftHead("h", lambda: True), _request()
    asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    head.verified({"r": VerifyResult("r", [9, 4], 1, head_draft=[5, 6, 7])})
    r.generated.append(9)  # the router emitted one token of the two: not where it drafted
    again = asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    assert again.trees == {} and again.asks["r"].stored == 0


def test_release_forgets_the_request() -> None:
    head, r = DraftHead("h", lambda: False), _request()
    assert not head.available and head.in_verifier and not head.can_score
    asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0))
    head.release("r")
    head.verified({"r": VerifyResult("r", [9], 0, head_draft=[5])})
    r.generated.append(9)
    assert asyncio.run(head.propose([(r, StepChoice("h", 3))], 1.0)).trees == {}
