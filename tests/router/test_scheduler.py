"""Scheduler pieces that need no services: the prompt-lookup scoring of a request's output, and
the model drafter that drafts when prompt lookup finds no match (its pool's call stubbed: it
records the tasks and answers a fixed chain)."""

from __future__ import annotations

import asyncio

from spin.engine.sampling import SamplingParams
from spin.policy.base import PROMPT_LOOKUP, FixedPolicy, StepChoice
from spin.router.pool import ReplicaPool
from spin.router.requests import RouterRequest
from spin.router.scheduler import Scheduler, SchedulerConfig
from spin.v1 import drafter_pb2, token_tree_pb2


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


class ChainPool(ReplicaPool):
    """A drafter pool whose every call answers the chain 7, 8 (the network call stubbed)."""

    def __init__(self) -> None:
        super().__init__("draft-code", "drafter", ["127.0.0.1:1"])
        self.tasks: list[drafter_pb2.DraftTask] = []

    async def call(self, batch, timeout_s: float | None = None):
        self.tasks += list(batch.tasks)
        return drafter_pb2.SpeculateResponse(results=[drafter_pb2.DraftResult(
            request_id=t.request_id, tree=token_tree_pb2.TokenTree(tokens=[7, 8], parents=[-1, 0]))
            for t in batch.tasks], draft_seconds=0.001)


def test_a_prompt_lookup_without_a_match_drafts_with_the_choice_instead() -> None:
    alt = StepChoice("draft-code", 2)
    matched = RouterRequest("m", prompt=(1, 2, 3, 1, 2), max_tokens=8, sampling=SamplingParams())
    unmatched = RouterRequest("u", prompt=(1, 2, 3, 4), max_tokens=8, sampling=SamplingParams())
    choices = [StepChoice(PROMPT_LOOKUP, 3, instead=alt), StepChoice(PROMPT_LOOKUP, 3, instead=alt)]

    async def draft() -> tuple[ChainPool, tuple]:
        pool = ChainPool()  # its clients need the running loop
        sched = Scheduler(SchedulerConfig(), ReplicaPool("target", "verifier"),
                          {"draft-code": pool}, FixedPolicy(), lambda ids: "", None)
        return pool, await sched._draft([matched, unmatched], choices)

    pool, (trees, seconds, _) = asyncio.run(draft())
    assert list(trees["m"].tokens) == [3, 1, 2]  # the lookup matched: no model call for it
    assert [t.request_id for t in pool.tasks] == ["u"] and pool.tasks[0].k == 2
    assert list(trees["u"].tokens) == [7, 8]
    assert choices == [StepChoice(PROMPT_LOOKUP, 3, instead=alt), alt]  # what ran, for observe
    assert seconds["draft-code"] == 0.001
