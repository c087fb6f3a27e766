"""Scheduler pieces that need no services: the prompt-lookup scoring of a request's output."""

from __future__ import annotations

import asyncio

from spin.engine.sampling import SamplingParams
from spin.policy.base import PROMPT_LOOKUP, FixedPolicy, StepChoice
from spin.router.pool import ReplicaPool
from spin.router.requests import RouterRequest
from spin.router.scheduler import Scheduler, SchedulerConfig


class Recording(FixedPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.scores: list[tuple[str, int, int]] = []

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

