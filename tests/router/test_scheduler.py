"""Scheduler pieces that need no services: the prompt-lookup scoring of a request's output."""

from __future__ import annotations

import asyncio

from spin.engine.sampling import SamplingParams
from spin.policy.base import PROMPT_LOOKUP, FixedPolicy, StepChoice
from spin.router.pool import ReplicaPool
from spin.router.requests import RouterRequest
from spin.router.config import SchedulerConfig
from spin.router.scheduler import Scheduler
from spin.v1 import verifier_pb2


class Recording(FixedPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.scores: list[tuple[str, int, int]] = []
        self.observed: list[tuple[StepChoice, int]] = []

    def observe(self, request_id: str, choice: StepChoice, accepted: int, draft_s: float,
                verify_s: float) -> None:
        self.observed.append((choice, accepted))

    def observe_score(self, request_id: str, drafter: str, matches: int, positions: int) -> None:
        self.scores.append((drafter, matches, positions))


def test_prompt_lookup_rounds_score_each_generated_token_once() -> None:
    policy = Recording()
    sched = Scheduler(SchedulerConfig(), ReplicaPool("target", "verifier"), {}, policy,
                      lambda ids: "", None)
    r = RouterRequest("r", prompt=(1, 2, 3, 4), max_tokens=64, sampling=SamplingParams())
    probe = [StepChoice(None, score=(PROMPT_LOOKUP,))]

    async def rounds() -> None:
        r.generated += [1, 2, 3, 4, 1]  # the lookup predicts 2, 3, 4, 1 after the first 1
        await sched._draft([r], probe)
        r.generated += [2, 3, 9]  # predicts 2 (then 3) correctly, 9 not
        await sched._draft([r], probe)

    asyncio.run(rounds())
    assert policy.scores == [(PROMPT_LOOKUP, 4, 5), (PROMPT_LOOKUP, 2, 3)]



def test_policy_observes_the_length_a_chain_stopped_at() -> None:
    """A chain that stopped early (``stop_below``) counts as the k it drafted: the acceptance
    estimate must see 2 of 2 accepted, not 2 of 8."""
    policy = Recording()
    sched = Scheduler(SchedulerConfig(), ReplicaPool("target", "verifier"), {}, policy,
                      lambda ids: "", None)
    r = RouterRequest("r", prompt=(1, 2, 3, 4), max_tokens=64, sampling=SamplingParams())
    sched.submit(r)
    stopped = StepChoice("draft-code", 8, stop_below=0.1)
    sched._apply(r, stopped, verifier_pb2.VerifyResult(tokens=[5, 6, 7], num_accepted=2), 2,
                 0.01, 0.02)
    tree = StepChoice("draft-code", 3, branching=(2,))  # a tree's node count is no length
    sched._apply(r, tree, verifier_pb2.VerifyResult(tokens=[8], num_accepted=0), 6, 0.01, 0.02)
    assert policy.observed == [(StepChoice("draft-code", 2, stop_below=0.1), 2), (tree, 0)]
    assert r.tallies["draft-code"].draft_tokens == 8 and r.generated == [5, 6, 7, 8]
