"""Suffix decoding in the router's pool: the proposer over a shared store (unit), its wiring and
flag, the scheduler feeding it every request, a repeated request through the embedded
deployment drafted from the earlier one's output, losslessly, and two routers sharing their
texts through Redis."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace

import pytest
from service_helpers import collect, scrape
from service_helpers import request as grpc_request
from router.test_scheduler import FakeDrafter, expected, request, scheduler, steps

from spin.engine.sampling import SamplingParams
from spin.engine.suffix_decoding import SUFFIX_DECODING, SuffixStore
from spin.policy.base import FixedPolicy, RequestView, StepChoice, branches, unmatched
from spin.router.config import RouterConfig, SchedulerConfig
from spin.router.requests import RequestParams, RouterRequest
from spin.router.suffix_proposer import SuffixDecoding
from spin.router_main import local_proposers

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing


def _req(rid: str, prompt: list[int], generated: list[int] = ()) -> RouterRequest:
    r = RouterRequest(RequestParams(rid, tuple(prompt), 64, SamplingParams()))
    r.generated = list(generated)
    return r


def _propose(p: SuffixDecoding, r: RouterRequest, k: int, branching: tuple[int, ...] = ()):
    return asyncio.run(p.propose([(r, StepChoice(SUFFIX_DECODING, k, branching))], 1.0)).trees


def test_a_later_request_is_drafted_from_an_earlier_ones_output() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(4096) for _ in range(30)]
    output = [rng.randrange(4096) for _ in range(20)]
    p = SuffixDecoding(SuffixStore())
    first = _req("a", prompt, output[:5])
    assert p.matches(first) == 0  # nothing earlier, nothing repeats
    first.generated = list(output)
    p.seen(first)  # the scheduler does this as the request finishes, then releases it
    p.release("a")
    second = _req("b", prompt)
    assert p.matches(second) == 1
    assert _propose(p, second, 8)["b"].tokens == tuple(output[:8])
    second.generated = output[:12]  # it went on as the first did
    assert _propose(p, second, 8)["b"].tokens == tuple(output[12:20])
    score = asyncio.run(p.score([(second, StepChoice(None, 0))], 1.0)).scores["b"]
    assert (score.matches, score.positions) == (12, 12)


def test_a_request_matches_its_own_earlier_text_and_a_reused_id_starts_afresh() -> None:
    p = SuffixDecoding(SuffixStore())
    r = _req("x", [5, 6, 7, 8, 9], [5, 6])
    assert _propose(p, r, 3)["x"].tokens == (7, 8, 9)
    p.seen(r)
    p.release("x")
    again = _req("x", [1, 2, 3])  # the same id, another request: not appended to the first's
    p.seen(again)
    assert len(p.store) == 2 and p.store.tokens == 7 + 3


def test_branching_asks_for_a_tree_of_two_continuations() -> None:
    p = SuffixDecoding(SuffixStore())
    for i, cont in enumerate(([3, 4], [7, 7], [3, 5])):
        p.seen(_req(f"e{i}", [1, 2, *cont]))
    r = _req("q", [9, 1, 2])
    assert p.matches(r) == 2
    tree = _propose(p, r, 2, (2,))["q"]
    assert tree.tokens == (3, 5, 7, 7) and tree.parents == (-1, 0, -1, 2)


def test_the_policy_treats_it_as_a_model_free_drafter() -> None:
    view = RequestView("r", 10, 2, 5, True, free_branches=((SUFFIX_DECODING, 0),))
    assert branches(view, SUFFIX_DECODING) == 0 and SUFFIX_DECODING in unmatched(view)
    assert branches(RequestView("r", 10, 2, 5, True), SUFFIX_DECODING) == 1


def test_the_flags_offer_it_by_default_and_take_it_away() -> None:
    names = [p.name for p in local_proposers(SchedulerConfig())]
    assert names[:2] == ["prompt-lookup", SUFFIX_DECODING]  # then the other model-free ones
    on = local_proposers(SchedulerConfig(suffix_store_tokens=123))[1]
    assert isinstance(on, SuffixDecoding) and on.store.max_tokens == 123
    off = [p.name for p in local_proposers(SchedulerConfig(suffix_decoding=False))]
    assert off[0] == "prompt-lookup" and SUFFIX_DECODING not in off


def test_the_scheduler_feeds_every_request_to_the_store_and_drafts_a_repeat() -> None:
    """Through the scheduler (fake replicas; the toy target goes on +1): the first request's
    whole context goes in as it finishes, and the same prompt again is drafted from it."""
    suffix = SuffixDecoding(SuffixStore())
    sched = scheduler(FixedPolicy(SUFFIX_DECODING, 4), drafters={"fake": FakeDrafter(2)},
                      local=(suffix,))
    first = request("one", (11, 12, 13, 14), max_tokens=30)
    second = request("two", (11, 12, 13, 14), max_tokens=30)

    async def go() -> None:
        sched.submit(first)
        await steps(sched)
        assert suffix.store.length("0:one") == len(first.context) == 34  # all of it, kept
        assert SUFFIX_DECODING not in first.tally.drafters  # nothing to draft from
        sched.submit(second)
        await steps(sched)
    asyncio.run(go())
    assert second.generated == first.generated == expected((11, 12, 13, 14), 30)  # lossless
    t = second.tally.drafters[SUFFIX_DECODING]
    assert t.accepted_tokens == t.draft_tokens == 24 and t.steps == 6, t  # 6 x (4 + 1) = 30


# ---- the embedded deployment (the shared ``serving`` fixture: suffix decoding is on) ------------

PROMPT = "    def rows(self, table):\n        cursor = self.conn.cursor()\n"


def test_a_repeated_request_is_drafted_by_suffix_decoding_and_lossless(serving) -> None:
    prompt = PROMPT + "        # suffix decoding test\n"  # no other test sends it
    off, _, _ = collect(serving.endpoint, grpc_request(prompt, max_tokens=40, mode="off",
                                                  ignore_eos=True))
    before = scrape(serving.router.metrics_port)
    ids, _, last = collect(serving.endpoint, grpc_request(prompt, max_tokens=40, mode="drafter",
                                                     drafter=SUFFIX_DECODING, k=8,
                                                     ignore_eos=True))
    after = scrape(serving.router.metrics_port)
    assert ids == off
    s = last.speculation
    assert s.drafters[0].drafter == SUFFIX_DECODING
    assert s.accepted_tokens >= 30, s  # the first request's output, drafted 8 at a time
    key = f'spin:spec_decode_num_accepted_tokens_total{{draft_model="{SUFFIX_DECODING}"}}'
    assert after[key] - before.get(key, 0) == s.accepted_tokens
    # and in mode auto, the same request once more: the policy may pick it, and the output holds
    auto, _, last = collect(serving.endpoint, grpc_request(prompt, max_tokens=40,
                                                               ignore_eos=True))
    assert auto == off


# ---- routers sharing their texts through Redis (``--suffix-share``) ---------------------------

def _sharing(cfg: RouterConfig) -> RouterConfig:
    return replace(cfg, scheduler=replace(cfg.scheduler, suffix_share=True))


def test_a_router_drafts_from_a_request_another_router_served(serving) -> None:
    """Two more routers over the embedded deployment, with ``--suffix-share`` on its Redis: a
    request served by one is drafted, by the other, from the first one's output (losslessly),
    and both count what they shared."""
    prompt = PROMPT + "        # shared between routers\n"  # no other test sends it
    routers = []
    try:
        a = serving.add_router("router-share-a", _sharing)
        routers.append(a)
        b = serving.add_router("router-share-b", _sharing)
        routers.append(b)
        off, _, _ = collect(f"127.0.0.1:{a.port}", grpc_request(
            prompt, max_tokens=40, mode="off", ignore_eos=True))
        key = 'spin:suffix_share_texts_total{event="received"}'
        deadline = time.monotonic() + 60
        while scrape(b.metrics_port).get(key, 0) < 1:
            assert time.monotonic() < deadline, "router b never received router a's text"
            time.sleep(0.1)
        ids, _, last = collect(f"127.0.0.1:{b.port}", grpc_request(
            prompt, max_tokens=40, mode="drafter", drafter=SUFFIX_DECODING, k=8,
            ignore_eos=True))
        assert ids == off
        assert last.speculation.accepted_tokens >= 30, last.speculation
        assert scrape(a.metrics_port)['spin:suffix_share_texts_total{event="published"}'] >= 1
    finally:
        for child in routers:
            child.stop(10.0)
            serving.children.remove(child)
