"""``Scheduler.step`` over in-process fakes of the services, answering from a toy model.

The toy target emits ``(last + 1) % V`` after any context; a toy drafter proposes a chain that is
right for its first ``right`` tokens, then wrong. The fakes keep each request's context by
``(keep, delta)`` the way a drafter or verifier does (resync when they do not hold ``keep``
tokens), so every output can be checked token by token against the target decoding alone.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import REGISTRY

from spin.engine.head_runner import HeadAsk
from spin.engine.sampling import SamplingParams
from spin.engine.tree import TokenTree
from spin.policy.base import (PROMPT_LOOKUP, FixedPolicy, RequestView, StepChoice, StepPlan,
                              StepPrediction)
from spin.router.admission import KVBudget
from spin.router.config import SchedulerConfig
from spin.policy.outcome import StepOutcome
from spin.router.pool import Kind, ReplicaPool
from spin.router.proposers import PromptLookup, Proposals, Proposer, Proposers
from spin.router.requests import RequestParams, RouterRequest
from spin.router.scheduler import Scheduler
from spin.router.services import (DraftTask, DrafterClients, ServiceDown, VerifierClient,
                                  VerifyTask)
from spin.rpc.convert import sampling_from_proto, tree_from_wire, tree_to_wire
from spin.v1 import drafter_pb2, verifier_pb2
from spin.router.streaming import Chunk, RequestError

# its outcome depends on time (deadlines, latency bounds): `make test-busy` runs it beside load
pytestmark = pytest.mark.timing

V = 97
"""The toy model's vocabulary."""


def token_prob(token: int) -> float:
    """The fake verifier's probability of a token it emits for a sampling request."""
    return (token % 10 + 1) / 20


def nxt(last: int, v: int = V) -> int:
    """The toy target's next token."""
    return (last + 1) % v


def expected(prompt: tuple[int, ...], n: int, v: int = V) -> list[int]:
    """What the target alone generates after ``prompt``."""
    out, last = [], prompt[-1]
    for _ in range(n):
        last = nxt(last, v)
        out.append(last)
    return out


# ---- the fakes ----------------------------------------------------------------------------------
class FakeService:
    """A replica's stream (what ``pool.ReplicaPool`` calls): contexts held per request, the
    calls received (as the router's plain tasks) and the releases taken."""

    def __init__(self, v: int = V) -> None:
        self.v = v
        self.held: dict[str, list[int]] = {}
        self.calls: list[tuple[list, set[str]]] = []
        self.released: list[str] = []
        self.available = True
        self.fail = 0
        """Calls to fail (ServiceDown) from now on."""
        self.forget: set[str] = set()
        """Requests whose context is lost before the next call (a restart): they resync."""

    async def close(self) -> None:
        return None

    async def _call(self, tasks: list, release: set[str]) -> None:
        await asyncio.sleep(0)  # like a round trip: other lanes may run meanwhile
        self.calls.append((list(tasks), set(release)))
        if self.fail:
            self.fail -= 1
            raise ServiceDown("asked to fail")
        for rid in sorted(release):
            self.held.pop(rid, None)
            self.released.append(rid)

    def _sync(self, task: DraftTask | VerifyTask) -> list[int] | None:
        """The context after the task's (keep, delta); None = resync."""
        if task.request_id in self.forget:
            self.forget.discard(task.request_id)
            self.held.pop(task.request_id, None)
        held = self.held.get(task.request_id)
        if task.keep > (len(held) if held is not None else 0) or not (task.keep or
                                                                      task.context_delta):
            return None
        ctx = self.held.setdefault(task.request_id, [])
        del ctx[task.keep:]
        ctx.extend(task.context_delta)
        return ctx

    def tasks(self) -> list:
        return [t for tasks, _ in self.calls for t in tasks]


class FakeVerifier(FakeService):
    """The toy target, verifying greedily; reports KV blocks; can preempt."""

    def __init__(self, v: int = V, free_blocks: int = 0, num_blocks: int = 0) -> None:
        super().__init__(v)
        self.free_blocks, self.num_blocks = free_blocks, num_blocks
        self.preempt: set[str] = set()
        """Requests to preempt at the next call."""

    async def call(self, batch: verifier_pb2.VerifyRequest, timeout_s: float | None = None
                   ) -> verifier_pb2.VerifyResponse:
        tasks = [VerifyTask(t.request_id, t.keep, list(t.context_delta),
                            tree_from_wire(t.tree) if t.HasField("tree") else None,
                            sampling_from_proto(t.sampling), steps=max(1, t.steps),
                            stop_ids=tuple(t.stop_token_ids)) for t in batch.tasks]
        await self._call(tasks, set(batch.release))
        results = []
        for t in tasks:
            ctx = self._sync(t)
            if ctx is None:
                results.append(verifier_pb2.VerifyResult(request_id=t.request_id, resync=True))
            elif t.request_id in self.preempt:
                self.preempt.discard(t.request_id)
                results.append(verifier_pb2.VerifyResult(request_id=t.request_id,
                                                         preempted=True))
            else:
                tokens = self._walk(t.tree, ctx[-1])
                while len(tokens) < t.steps and tokens[-1] not in t.stop_ids:  # plain steps
                    tokens += self._walk(None, tokens[-1])
                ctx.extend(tokens)
                results.append(verifier_pb2.VerifyResult(
                    request_id=t.request_id, tokens=tokens, num_accepted=len(tokens) - 1,
                    token_probs=[token_prob(x) for x in tokens] if not t.sampling.greedy
                    else []))
        return verifier_pb2.VerifyResponse(results=results, verify_seconds=0.001,
                                           free_blocks=self.free_blocks,
                                           num_blocks=self.num_blocks)

    def _walk(self, tree: TokenTree | None, last: int) -> list[int]:
        """The accepted path of ``tree`` and the target's token after it."""
        out, node = [], -1
        while True:
            want = nxt(last, self.v)
            out.append(want)
            child = next((c for c in (tree.children(node) if tree is not None else [])
                          if tree.tokens[c] == want), None)
            if child is None:
                return out
            node, last = child, want


class FakeDrafter(FakeService):
    """Chains right for their first ``right`` tokens, at most ``length`` long."""

    def __init__(self, right: int, length: int = 1000, v: int = V) -> None:
        super().__init__(v)
        self.right, self.length = right, length

    async def call(self, batch: drafter_pb2.SpeculateRequest, timeout_s: float | None = None
                   ) -> drafter_pb2.SpeculateResponse:
        tasks = [DraftTask(t.request_id, t.keep, list(t.context_delta), t.k,
                           sampling_from_proto(t.sampling), tuple(t.branching), score=t.score,
                           score_from=t.score_from, stop_below=t.stop_below,
                           context_probs=list(t.context_probs)) for t in batch.tasks]
        await self._call(tasks, set(batch.release))
        results = [self._draft(t) for t in tasks]
        return drafter_pb2.SpeculateResponse(results=results, draft_seconds=0.002)

    def _draft(self, t: DraftTask) -> drafter_pb2.DraftResult:
        ctx = self._sync(t)
        res = drafter_pb2.DraftResult(request_id=t.request_id)
        if ctx is None:
            res.resync = True
        elif t.k <= 0 and t.context_probs:  # echoes the target's probabilities it got
            known = [p for p in t.context_probs if p > 0]
            res.score_positions = res.score_acceptance_positions = len(known)
            res.score_acceptance = sum(known)
        elif t.k <= 0:
            res.score_matches = res.score_positions = len(ctx) - t.score_from if t.score else 0
        else:
            chain, last = [], ctx[-1]
            for i in range(min(t.k, self.length)):
                last = nxt(last, self.v) if i < self.right else (nxt(last, self.v) + 1) % self.v
                chain.append(last)
            res.tree.CopyFrom(tree_to_wire(TokenTree.chain(chain)))
        return res


class Recording(FixedPolicy):
    """The fixed policy, remembering what it was told; ``predict`` attaches a prediction."""

    def __init__(self, drafter: str | None = "fake", k: int = 4,
                 predict: StepPrediction | None = None, stop_below: float = 0.0) -> None:
        super().__init__(drafter, k, fallback=None)
        self.predict, self.stop_below = predict, stop_below
        self.ask: int | None = None
        """Every choice's ``StepChoice.ask``."""
        self.hold = 1
        """Every plan's ``StepPlan.hold``."""
        self.observed: list[tuple[str, StepChoice, int]] = []
        self.ranks: list = []
        self.scores: list[tuple[str, int, int]] = []
        self.accepted: list[float | None] = []
        self.steps: list[StepPrediction] = []
        self.released: list[str] = []
        self.outcomes: list[StepOutcome] = []

    def choose(self, requests: list[RequestView], available: set[str],
               heads: frozenset[str] = frozenset()) -> StepPlan:
        plan = super().choose(requests, available)
        if self.stop_below or self.ask is not None:
            plan = StepPlan([StepChoice(c.drafter, c.k, stop_below=self.stop_below, ask=self.ask)
                             if c.drafter else c for c in plan])
        plan.prediction, plan.hold = self.predict, self.hold
        return plan

    def observe(self, outcome: StepOutcome) -> None:
        self.outcomes.append(outcome)
        for r in outcome.requests:
            for sc in r.scores:
                self.scores.append((sc.drafter, sc.matches, sc.positions))
                self.accepted.append(sc.accepted)
            if r.verified:
                self.observed.append((r.request_id, r.choice, r.accepted))
                self.ranks.append(r.ranks)
        if outcome.prediction is not None:
            self.steps.append(outcome.prediction)

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class Store:
    def __init__(self) -> None:
        self.records: list[tuple[str, int, int]] = []
        self.rejected: list[bool | None] = []

    def record(self, drafter: str, k: int, accepted: int, draft_s: float, verify_s: float,
               rejected: bool | None = None) -> None:
        self.records.append((drafter, k, accepted))
        self.rejected.append(rejected)

    def population(self) -> dict:
        return {}


def pool(name: str, kind: Kind, fake: FakeService) -> ReplicaPool:
    """A real replica pool over one fake replica."""
    return ReplicaPool(name, kind, ["fake:1"], client=lambda n, a, k: fake)


def scheduler(policy: FixedPolicy | None = None, drafters: dict[str, FakeDrafter] | None = None,
              verifier: FakeVerifier | None = None, store: Store | None = None,
              kv: KVBudget | None = None, translators: dict | None = None,
              local: tuple[Proposer, ...] | None = None, **cfg) -> Scheduler:
    """A scheduler over real pools and proposers of fake replicas (prompt lookup off unless
    ``prompt_lookup``)."""
    lookup = cfg.pop("prompt_lookup", False)
    drafters = drafters if drafters is not None else {"fake": FakeDrafter(2)}
    clients = DrafterClients({n: pool(n, "drafter", d) for n, d in drafters.items()})
    proposers = Proposers(clients, translators, local if local is not None else
                          (PromptLookup(),) if lookup else ())
    return Scheduler(SchedulerConfig(**cfg), VerifierClient(pool("verifier", "verifier",
                                                                 verifier or FakeVerifier())),
                     proposers, policy or Recording(), lambda ids: " ".join(map(str, ids)),
                     None, store, kv)


def request(rid: str, prompt: tuple[int, ...] = (1, 2, 3), max_tokens: int = 20,
            sampling: SamplingParams | None = None, **kw) -> RouterRequest:
    return RouterRequest(RequestParams(rid, prompt, max_tokens, sampling or SamplingParams(),
                                       **kw))


def held(sched: Scheduler, service: str, rid: str) -> int | None:
    """What the router's record says ``service`` holds of ``rid`` (None: nothing known)."""
    pools = {"verifier": sched.verifier.pool, **sched.proposers.drafters.pools}
    return pools[service].held.get(rid)


async def steps(sched: Scheduler, limit: int = 500) -> int:
    """Step the whole batch as one micro-batch until nothing is left; the steps taken."""
    n = 0
    while (sched.running or sched.waiting) and n < limit:
        sched.admit()
        await sched.step(list(sched.running))
        n += 1
    return n


def events(r: RouterRequest) -> list:
    out = []
    while not r.out.empty():
        out.append(r.out.get_nowait())
    return out


def tokens(chunks: list[Chunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- the step -----------------------------------------------------------------------------------
@pytest.mark.parametrize("right, k", [(0, 4), (2, 4), (10, 4), (3, 1), (5, 8)])
def test_speculation_is_lossless(right: int, k: int) -> None:
    async def go() -> None:
        sched = scheduler(Recording("fake", k), {"fake": FakeDrafter(right)}, plain_steps=1)
        spec = [request(f"s{i}", (i, 2 * i, 3 * i), max_tokens=17 + i) for i in range(3)]
        off = [request(f"o{i}", (i, 2 * i, 3 * i), max_tokens=17 + i, mode="off")
               for i in range(3)]
        for r in spec + off:
            sched.submit(r)
        await steps(sched)
        for s, o in zip(spec, off):
            got, plain = events(s), events(o)
            assert tokens(got) == tokens(plain) == expected(s.prompt, s.params.max_tokens)
            assert got[-1].finish == "length" and len(plain) == s.params.max_tokens
            if right:  # accepted drafts: fewer steps than tokens
                assert len(got) < s.params.max_tokens
            for c in got[:-1]:  # the accepted drafts and the target's own token
                assert len(c.token_ids) == c.step.accepted_tokens + 1 == min(right, k) + 1
    asyncio.run(go())


def test_contexts_sync_by_keep_and_delta() -> None:
    """Each service gets the prompt once, then only what it lacks: the verifier holds the tokens
    it verified (nothing to send), a drafter gets the previous step's tokens."""
    async def go() -> None:
        drafter, verifier = FakeDrafter(2), FakeVerifier()
        sched = scheduler(Recording("fake", 4), {"fake": drafter}, verifier)
        r = request("r", max_tokens=31)
        sched.submit(r)
        await steps(sched)
        chunks, p = events(r), len(r.prompt)
        sent = verifier.tasks()
        assert len(sent) == len(chunks) and (sent[0].keep, sent[0].context_delta) == (0, [1, 2, 3])
        for i, task in enumerate(sent[1:], 1):
            assert (task.keep, task.context_delta) == (p + len(tokens(chunks[:i])), [])
        drafted = drafter.tasks()
        assert 0 < len(drafted) < len(chunks)  # the last steps have no room for a draft
        assert (drafted[0].keep, drafted[0].context_delta) == (0, [1, 2, 3])
        for i, task in enumerate(drafted[1:], 1):
            assert task.keep == p + len(tokens(chunks[:i - 1]))
            assert task.context_delta == chunks[i - 1].token_ids
        assert verifier.held["r"] == r.context  # released with its next call
        assert drafter.held["r"] == r.context[:p + len(tokens(chunks[:len(drafted) - 1]))]
    asyncio.run(go())


class Calibrated(Recording):
    """A policy whose cost model has been corrected in serving."""

    def calibration(self) -> dict[tuple[str, str], float]:
        return {("verify_plain", ""): 1.25, ("draft", "fake"): 3.0}


def test_the_policy_s_cost_model_corrections_are_exported_after_each_step() -> None:
    async def go() -> None:
        sched = scheduler(Calibrated(), {"fake": FakeDrafter(2)})
        sched.submit(request("cal", max_tokens=5))
        await steps(sched)
        assert sample("spin:cost_model_calibration", part="verify_plain", draft_model="") == 1.25
        assert sample("spin:cost_model_calibration", part="draft", draft_model="fake") == 3.0
    asyncio.run(go())


def test_a_failed_drafter_costs_one_step_without_speculation() -> None:
    async def go() -> None:
        drafter = FakeDrafter(3)
        sched = scheduler(Recording("flaky", 4), {"flaky": drafter})
        failures = sample("spin:drafter_failures_total", draft_model="flaky")
        r = request("r", max_tokens=24)
        sched.submit(r)
        await sched.step([r])
        drafter.fail = 1
        await sched.step([r])
        await steps(sched)
        got = events(r)
        assert tokens(got) == expected(r.prompt, 24)
        assert [c.step.drafter for c in got][:3] == ["flaky", "", "flaky"]
        assert (got[1].step.k, got[1].step.draft_tokens, len(got[1].token_ids)) == (0, 0, 1)
        assert sample("spin:drafter_failures_total", draft_model="flaky") == failures + 1
        resent = drafter.tasks()[2]  # after the failure: the whole context again
        assert resent.keep == 0 and resent.context_delta == r.context[:len(resent.context_delta)]
        assert len(resent.context_delta) == len(r.prompt) + len(tokens(got[:2]))
        assert got[-1].speculation.steps_without_speculation == 1
    asyncio.run(go())


def test_resync_resends_the_whole_context_and_changes_nothing() -> None:
    async def go() -> None:
        drafter, verifier = FakeDrafter(2), FakeVerifier()
        sched = scheduler(Recording("fake", 4), {"fake": drafter}, verifier)
        r = request("r", max_tokens=20)
        sched.submit(r)
        await sched.step([r])
        await sched.step([r])
        verifier.forget.add("r")  # a restarted verifier: it no longer holds the request
        drafter.forget.add("r")
        before = len(r.generated)
        await sched.step([r])
        assert len(r.generated) == before  # nothing verified this step, nothing streamed
        assert held(sched, "verifier", "r") is None and held(sched, "fake", "r") is None
        await sched.step([r])
        whole = verifier.tasks()[3]
        assert whole.keep == 0 and len(whole.context_delta) == len(r.prompt) + before
        await steps(sched)
        got = events(r)
        assert tokens(got) == expected(r.prompt, 20) and len(got) == r.tally.steps
    asyncio.run(go())


def test_preempted_request_is_requeued_and_its_output_unchanged() -> None:
    async def go() -> None:
        verifier = FakeVerifier()
        sched = scheduler(Recording("fake", 4), verifier=verifier)
        a, b = request("a", max_tokens=20), request("b", (5, 6, 7), max_tokens=20)
        sched.submit(a)
        sched.submit(b)
        await sched.step(list(sched.running))
        verifier.preempt.add("b")
        before = b.context_len
        await sched.step(list(sched.running))
        assert list(sched.waiting) == [b] and sched.running == [a] and b.tally.preemptions == 1
        assert held(sched, "verifier", "b") == before  # the verifier kept its context
        sched.admit()
        await sched.step(list(sched.running))
        again = [t for t in verifier.tasks() if t.request_id == "b"][-1]
        assert (again.keep, again.context_delta) == (before, [])  # no prefill from the router
        await steps(sched)
        for r in (a, b):
            assert tokens(events(r)) == expected(r.prompt, 20)
    asyncio.run(go())


def test_releases_ride_along_with_the_next_calls() -> None:
    async def go() -> None:
        drafter, verifier = FakeDrafter(1), FakeVerifier()
        policy = Recording("fake", 2)
        sched = scheduler(policy, {"fake": drafter}, verifier)
        short, long = request("short", max_tokens=3), request("long", max_tokens=30)
        sched.submit(short)
        sched.submit(long)
        while not short.finished:
            await sched.step(list(sched.running))
        calls = len(verifier.calls), len(drafter.calls)
        assert "short" in policy.released and not verifier.released
        await sched.step(list(sched.running))
        (v_tasks, v_release), = verifier.calls[calls[0]:]
        (d_tasks, d_release), = drafter.calls[calls[1]:]
        assert v_release == d_release == {"short"}  # with the next batch of each service
        assert [t.request_id for t in v_tasks] == [t.request_id for t in d_tasks] == ["long"]
        assert "short" not in verifier.held and "short" not in drafter.held
    asyncio.run(go())


def test_step_info_and_accounting() -> None:
    async def go() -> None:
        store = Store()
        prediction = StepPrediction(0.25, {"acct": 0.1}, 0.15)
        policy = Recording("acct", 4, predict=prediction)
        sched = scheduler(policy, {"acct": FakeDrafter(2)}, store=store)
        before = {n: sample(f"spin:spec_decode_{n}_total", draft_model="acct")
                  for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        tokens_before = sample("spin:generation_tokens_total")
        r = request("r", max_tokens=25)
        sched.submit(r)
        n = await steps(sched)
        got = events(r)
        spec = got[-1].speculation
        assert len(got) == n == spec.steps == r.tally.steps and got[-1].usage.completion_tokens == 25
        assert got[-1].usage.prompt_tokens == 3 and spec.tau == pytest.approx(25 / n)
        assert sum(c.step.accepted_tokens for c in got) == spec.accepted_tokens
        assert sum(c.step.draft_tokens for c in got) == spec.draft_tokens
        assert all(c.step.predicted_step_seconds == pytest.approx(0.25) for c in got)
        assert all(c.step.batch_size == 1 and c.step.step_seconds > 0 for c in got)
        drafted = [c for c in got if c.step.drafter == "acct"]
        assert (spec.drafters[0].drafter, spec.drafters[0].steps) == ("acct", len(drafted))
        assert spec.steps_without_speculation == n - len(drafted)
        assert sample("spin:spec_decode_num_drafts_total", draft_model="acct") - \
            before["num_drafts"] == len(drafted)
        assert sample("spin:spec_decode_num_draft_tokens_total", draft_model="acct") - \
            before["num_draft_tokens"] == spec.draft_tokens
        assert sample("spin:spec_decode_num_accepted_tokens_total", draft_model="acct") - \
            before["num_accepted_tokens"] == spec.accepted_tokens
        assert sample("spin:generation_tokens_total") - tokens_before == 25
        assert store.records == [("acct", c.step.draft_tokens, c.step.accepted_tokens)
                                 for c in drafted]
        assert store.rejected == [c.step.accepted_tokens < c.step.draft_tokens for c in drafted]
        assert policy.steps == [prediction] * n
        assert [a for _, _, a in policy.observed] == [c.step.accepted_tokens for c in got]
    asyncio.run(go())


def test_sampling_requests_steps_count_in_their_own_population_entry() -> None:
    async def go() -> None:
        store = Store()
        sched = scheduler(Recording("acct", 4), {"acct": FakeDrafter(2)}, store=store)
        sched.submit(request("greedy", max_tokens=6))
        sched.submit(request("sampled", (1, 2, 3), 6, SamplingParams(temperature=0.8, seed=1)))
        await steps(sched)
        names = [name for name, _, _ in store.records]
        assert set(names) == {"acct", "acct@sampled"}
        assert names.count("acct") == names.count("acct@sampled")  # one per step of each
    asyncio.run(go())


def test_kv_admission_follows_the_verifier_reports() -> None:
    async def go() -> None:
        verifier = FakeVerifier(free_blocks=3, num_blocks=100)
        sched = scheduler(Recording(None), {}, verifier, kv=KVBudget(16, 100, 100))
        a = request("a", tuple(range(40)), max_tokens=10)
        b = request("b", tuple(range(1, 41)), max_tokens=10)
        sched.submit(a)
        await sched.step([a])
        assert (sched.kv.free, sched.kv.pending) == (3, 0)  # the reply's count, a verified
        sched.submit(b)  # 3 blocks and the watermark (1) do not fit in 3 free
        assert list(sched.waiting) == [b] and sched.running == [a]
        verifier.free_blocks = 50
        await sched.step([a])
        sched.admit()
        assert sched.running == [a, b] and sched.kv.pending == 3
        await steps(sched)
        assert tokens(events(b)) == expected(b.prompt, 10)
    asyncio.run(go())


def test_a_prompt_prefix_sent_before_reaches_the_policy_as_likely_cached() -> None:
    """The policy predicts a first step's prefill from the prompt less the prefix the router
    sent the verifier before (``RequestView.cached``, whole 16-token blocks)."""
    async def go() -> None:
        sched = scheduler(Recording(None), {})
        a = request("a", tuple(range(40)), max_tokens=4)
        b = request("b", tuple(range(36)) + (7, 7, 7, 7), max_tokens=4)
        c = request("c", tuple(range(100, 140)), max_tokens=4)
        sched.submit(a)
        await sched.step([a])  # a's prompt sent to the verifier
        for r in (b, c):
            sched.submit(r)
        assert [r.cached for r in (a, b, c)] == [0, 32, 0]  # b shares a's first two blocks
        assert [sched._view(r).cached for r in (a, b, c)] == [0, 32, 0]
        await steps(sched)
        assert tokens(events(b)) == expected(b.prompt, 4)
    asyncio.run(go())


def test_verifier_outage_fails_the_requests_with_unavailable() -> None:
    async def go() -> None:
        verifier = FakeVerifier()
        sched = scheduler(Recording(None), {}, verifier, verifier_outage_s=0.05)
        errors = sample("spin:request_errors_total", code="UNAVAILABLE")
        r = request("r")
        sched.submit(r)
        await sched.step([r])
        verifier.fail = 100
        await sched.step([r])
        assert not r.finished and held(sched, "verifier", "r") is None  # whole contexts next
        await asyncio.sleep(0.06)
        await sched.step([r])
        *_, last = events(r)
        assert isinstance(last, RequestError) and last.code == "unavailable"
        assert r.finished and sched.running == []
        assert sample("spin:request_errors_total", code="UNAVAILABLE") == errors + 1
    asyncio.run(go())


def test_prompt_lookup_rounds_score_each_generated_token_once() -> None:
    async def go() -> None:
        class Probe(Recording):
            def choose(self, requests, available, heads=frozenset()):
                return StepPlan([StepChoice(None, score=(PROMPT_LOOKUP,)) for _ in requests])

        policy = Probe()
        sched = scheduler(policy, {}, FakeVerifier(v=5), prompt_lookup=True)
        r = request("r", (1, 2, 3, 4), max_tokens=12)  # then 0 1 2 3 4 0 1 ...: it repeats
        sched.submit(r)
        await steps(sched)
        positions = [p for _, _, p in policy.scores]
        assert sum(positions) == 11  # every token but the last step's, once
        assert positions[0] == 0 and set(positions[1:]) == {1}
        hits = [m for _, m, _ in policy.scores]
        assert hits[1:3] == [0, 0] and hits[-1] == 1  # 0 and 1 are new; the rest repeats
    asyncio.run(go())


@pytest.mark.parametrize("greedy", [True, False])
def test_a_sampling_request_s_scoring_calls_carry_the_target_s_probabilities(greedy) -> None:
    """The verifier's probability of each emitted token travels, aligned, with the next scoring
    call's delta; the drafter's acceptance estimate reaches the policy. Greedy requests send
    none and their scores carry no estimate."""
    async def go() -> None:
        class Probe(Recording):
            def choose(self, requests, available, heads=frozenset()):
                return StepPlan([StepChoice(None, score=("fake",)) for _ in requests])

        policy, drafter = Probe(), FakeDrafter(2)
        sched = scheduler(policy, {"fake": drafter})
        sampling = SamplingParams() if greedy else SamplingParams(temperature=0.8, seed=3)
        r = request("r", (1, 2, 3), 8, sampling)
        sched.submit(r)
        await steps(sched)
        out = expected((1, 2, 3), 8)
        assert r.generated == out
        sent = [t.context_probs for t in drafter.tasks()]
        if greedy:
            assert r.token_probs == [] and all(not p for p in sent)
            assert set(policy.accepted) == {None}
            return
        # through the wire as float32
        assert r.token_probs == pytest.approx([token_prob(x) for x in out], rel=1e-6)
        # step 1 scores the prompt (no probabilities); then each call brings the last token's
        assert sent[0] == [] and [p for (p,) in sent[1:]] == pytest.approx(
            [token_prob(x) for x in out[:-1]], rel=1e-6)
        assert policy.accepted[1:] == pytest.approx([token_prob(x) for x in out[:-1]], rel=1e-6)
    asyncio.run(go())


def test_policy_observes_the_length_a_chain_stopped_at() -> None:
    """A chain that stopped early (``stop_below``) counts as the k it drafted: the acceptance
    estimate must see 2 of 2 accepted, not 2 of 8."""
    async def go() -> None:
        policy = Recording("short", 8, stop_below=0.1)
        sched = scheduler(policy, {"short": FakeDrafter(right=5, length=2)})
        r = request("r", max_tokens=40)
        sched.submit(r)
        await sched.step([r])
        _, choice, accepted = policy.observed[0]
        assert (choice, accepted) == (StepChoice("short", 2, stop_below=0.1), 2)
        assert r.tally.drafters["short"].draft_tokens == 2 and r.generated == expected(r.prompt, 3)
    asyncio.run(go())


class Shifted:
    """A stand-in translator: the drafter's token for target token t is t + 1000."""

    def context(self) -> Shifted.Context:
        return Shifted.Context()

    class Context:
        def __init__(self) -> None:
            self.draft: list[int] = []
            self.seen = self.stable = 0

        def extend(self, new: list[int]) -> None:
            self.draft += [t + 1000 for t in new]
            self.seen += len(new)

        def sync(self, held: int) -> tuple[int, list[int]]:
            keep = max(0, min(held, self.stable, len(self.draft)))
            self.stable = len(self.draft)
            return keep, self.draft[keep:]

        def propose(self, chain: list[int], k: int) -> list[int]:
            return [t - 1000 for t in chain][:k]


def test_a_drafter_with_another_tokenizer_drafts_through_translation() -> None:
    async def go() -> None:
        drafter = FakeDrafter(3, v=10**6)  # the toy target's rule, in the drafter's tokens
        sched = scheduler(Recording("other", 4), {"other": drafter},
                          translators={"other": Shifted()})
        r = request("r", (1, 2, 3), 20, SamplingParams(temperature=0.7, seed=1))
        sched.submit(r)
        await steps(sched)
        got = events(r)
        assert tokens(got) == expected(r.prompt, 20)
        assert got[0].step.drafter == "other" and got[0].step.accepted_tokens == 3
        first, second = drafter.tasks()[:2]
        assert (first.keep, first.context_delta) == (0, [1001, 1002, 1003])
        assert second.keep == 3 and second.context_delta == [t + 1000 for t in got[0].token_ids]
        assert first.sampling == SamplingParams()  # a greedy chain, whatever the request samples
    asyncio.run(go())


# ---- the lanes ----------------------------------------------------------------------------------
async def _until(cond, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        await asyncio.sleep(0.001)


async def _collect(r: RouterRequest) -> list:
    out = []
    while True:
        event = await r.out.get()
        out.append(event)
        if isinstance(event, RequestError) or event.finish is not None:
            return out


def test_two_lanes_are_lossless_and_split_the_batch() -> None:
    async def go() -> None:
        verifier, drafter = FakeVerifier(), FakeDrafter(2)
        sched = scheduler(Recording("fake", 3), {"fake": drafter}, verifier, micro_batches=2)
        loop = asyncio.create_task(sched.run())
        reqs = [request(f"r{i}", (i, i + 1), max_tokens=15 + i) for i in range(4)]
        for r in reqs:
            sched.submit(r)
        outs = await asyncio.gather(*(_collect(r) for r in reqs))
        await _until(lambda: sorted(verifier.released) == sorted(r.request_id for r in reqs))
        sched.stop()
        await loop
        for r, out in zip(reqs, outs):
            assert tokens(out) == expected(r.prompt, r.params.max_tokens)
        sizes = [len(tasks) for tasks, _ in verifier.calls if tasks]
        assert max(sizes) == 2  # two lanes of two
        assert sorted(drafter.released) == sorted(r.request_id for r in reqs)  # idle: flushed
    asyncio.run(go())


def test_a_cancelled_request_is_released_everywhere() -> None:
    async def go() -> None:
        verifier, drafter = FakeVerifier(), FakeDrafter(1)
        policy = Recording("fake", 2)
        sched = scheduler(policy, {"fake": drafter}, verifier)
        loop = asyncio.create_task(sched.run())
        r = request("r", max_tokens=10_000)
        sched.submit(r)
        await r.out.get()
        sched.cancel(r)
        await _until(lambda: "r" in verifier.released and "r" in drafter.released)
        sched.stop()
        await loop
        assert r.finished and policy.released == ["r"] and not sched.running
    asyncio.run(go())


def test_a_failing_step_ends_its_requests_with_internal() -> None:
    async def go() -> None:
        class Broken(Recording):
            def choose(self, requests, available, heads=frozenset()):
                raise RuntimeError("policy bug")

        sched = scheduler(Broken())
        loop = asyncio.create_task(sched.run())
        r = request("r")
        sched.submit(r)
        (error,) = await _collect(r)
        sched.stop()
        await loop
        assert error == RequestError("internal", "router step failed: policy bug")
    asyncio.run(go())


class Oracle(Proposer):
    """A drafter kind the scheduler has never heard of: it knows the toy target's rule."""

    name = "oracle"

    def __init__(self) -> None:
        self.released: list[str] = []

    @property
    def available(self) -> bool:
        return True

    async def propose(self, group, timeout_s: float) -> Proposals:
        out = Proposals(seconds=0.0)
        for r, c in group:
            out.trees[r.request_id] = TokenTree.chain(expected((r.context[-1],), c.k))
        return out

    async def score(self, group, timeout_s: float) -> Proposals:
        return Proposals()

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class FirstAsk(Oracle):
    """A draft head at a request's first step with it: it asks the verifier for a chain and
    proposes none."""

    name = "first-ask"
    in_verifier = True

    async def propose(self, group, timeout_s: float) -> Proposals:
        out = Proposals(seconds=0.0)
        for r, c in group:
            out.asks[r.request_id] = HeadAsk(self.name, k=c.k if c.ask is None else c.ask,
                                             stored=0)
        return out


@pytest.mark.parametrize("ask", [None, 0])
def test_a_heads_first_step_is_an_outcome_without_a_draft_that_asked(ask: int | None) -> None:
    """The step's outcome says the request asked a head (``RequestOutcome.asked``: the loss
    guard weighs it as speculation's cost) though it verified no draft (no drafter); a step
    that asked for no chain (``StepChoice.ask`` = 0) and had none is a plain one."""
    async def go() -> None:
        policy = Recording("first-ask", 4)
        if ask is not None:
            policy.ask = ask
        sched = scheduler(policy, {}, local=(FirstAsk(),))
        r = request("r", max_tokens=3)
        sched.submit(r)
        await sched.step(list(sched.running))
        (o,) = policy.outcomes[0].requests
        assert o.asked == (ask is None) and o.choice.drafter is None and o.verified
        assert o.emitted == 1
        assert tokens(events(r)) == expected(r.prompt, 1)
    asyncio.run(go())


def test_a_new_proposer_kind_drafts_without_a_change_to_the_scheduler() -> None:
    """A proposer is a class and a registry entry (``Proposers``): the scheduler drafts with it,
    verifies, releases it, and the policy hears of it in the step's one outcome."""
    async def go() -> None:
        oracle, policy = Oracle(), Recording("oracle", 4)
        sched = scheduler(policy, {}, local=(oracle,))
        assert list(sched.proposers) == ["oracle"]
        r = request("r", max_tokens=20)
        sched.submit(r)
        n = await steps(sched)
        got = events(r)
        assert tokens(got) == expected(r.prompt, 20)
        assert [c.step.accepted_tokens for c in got] == [4, 4, 4, 4]
        assert n == 4 and len(policy.outcomes) == n  # one report per step, nothing else
        assert oracle.released == ["r"] and r.tally.drafters["oracle"].accepted_tokens == 16
    asyncio.run(go())


def test_each_step_reaches_the_policy_as_one_outcome_of_the_whole_micro_batch() -> None:
    async def go() -> None:
        prediction = StepPrediction(0.02, {"fake": 0.005}, 0.015)
        policy = Recording("fake", 3, predict=prediction)
        sched = scheduler(policy, {"fake": FakeDrafter(2)})
        reqs = [request(f"r{i}", (i, i + 1, i + 2), max_tokens=9) for i in range(3)]
        for r in reqs:
            sched.submit(r)
        await sched.step(list(sched.running))
        (step,) = policy.outcomes
        assert [o.request_id for o in step.requests] == ["r0", "r1", "r2"]
        assert all(o.verified and (o.drafted, o.accepted, o.emitted) == (3, 2, 3)
                   for o in step.requests)
        assert step.prediction == prediction and step.draft_s == {"fake": 0.002}
        assert step.verify_s == 0.001 and step.step_s >= step.draft_wait_s + step.verify_wait_s
        assert step.drafters_called == {"fake": True}
    asyncio.run(go())


def test_requests_with_speculation_off_take_several_plain_steps_a_call() -> None:
    """A lane whose requests all have speculation off asks the verifier for ``plain_steps``
    tokens a call (a request's first step alone, its last cut to what it may still generate, a
    stop token ending it): the same tokens, fewer round trips, each forward counted as a step,
    and no calibration on such a call; a lane with a request in mode auto (speculating or not)
    or with requests waiting for admission asks for one."""
    async def go() -> None:
        verifier, policy = FakeVerifier(), Recording("fake", 4, StepPrediction(0.01, {}, 0.01))
        sched = scheduler(policy, verifier=verifier, plain_steps=4)
        before = sample("spin:spec_decode_steps_total", draft_model="")
        off = request("o", (5, 6, 7), max_tokens=10, mode="off")
        sched.submit(off)
        await steps(sched)
        got = events(off)
        assert tokens(got) == expected(off.prompt, 10) and got[-1].finish == "length"
        assert [len(c.token_ids) for c in got] == [1, 4, 4, 1]
        assert [t.steps for t in verifier.tasks()] == [1, 4, 4, 1]
        assert got[-1].speculation.steps == off.tally.steps == 10
        assert sample("spin:spec_decode_steps_total", draft_model="") - before == 10
        assert len(policy.steps) == 2  # calibrated on the calls of one forward only
        stop = FakeVerifier()
        sched = scheduler(Recording("fake", 4), verifier=stop, plain_steps=4)
        sched.stream.eos_id = 9
        sched.submit(ended := request("e", (5, 6, 7), max_tokens=10, mode="off"))
        await steps(sched)
        assert tokens(events(ended)) == [8, 9] and [t.stop_ids for t in stop.tasks()] == [(9,)] * 2
        mixed = FakeVerifier()
        sched = scheduler(Recording("fake", 4), verifier=mixed, plain_steps=4, max_batch=2)
        reqs = [request("a", mode="off"), request("b"), request("c", mode="off")]
        for r in reqs:
            sched.submit(r)
        await steps(sched)
        for r in reqs:
            assert tokens(events(r)) == expected(r.prompt, 20)
        with_b = [any(t.request_id == "b" for t in tasks) for tasks, _ in mixed.calls]
        asked = [{t.steps for t in tasks} for tasks, _ in mixed.calls]
        assert all(a == {1} for a, b in zip(asked, with_b) if b)  # b speculates; c waits
        assert {4} in asked  # a and c alone, once b has ended and nothing waits
        auto = FakeVerifier()  # the policy drafting nothing for a request it may speculate for
        sched = scheduler(Recording(None, 0), verifier=auto, plain_steps=4)
        sched.submit(r := request("p", max_tokens=6))
        await steps(sched)
        assert tokens(events(r)) == expected(r.prompt, 6) and {t.steps for t in auto.tasks()} == {1}
        queue = FakeVerifier()  # one slot: y waits while x decodes
        sched = scheduler(Recording(), verifier=queue, plain_steps=4, max_batch=1)
        for r in (x := request("x", mode="off"), y := request("y", mode="off")):
            sched.submit(r)
        await steps(sched)
        assert tokens(events(x)) == tokens(events(y)) == expected(x.prompt, 20)
        by = {rid: {t.steps for t in queue.tasks() if t.request_id == rid} for rid in "xy"}
        assert by == {"x": {1}, "y": {1, 4, 3}}  # y: 1 + 4 x 4 + the last 3
    asyncio.run(go())


@pytest.mark.parametrize("drafter", [None, "fake"])
def test_a_plain_plan_the_policy_holds_takes_several_plain_steps_a_call(drafter) -> None:
    """A plan in which no request drafts, held by the policy for 3 forwards (``StepPlan.hold``:
    the loss guard's plain steps until its next probe), runs that many a call within
    ``plain_steps`` (a first step alone), the outcome counting its forwards; a plan that
    drafts runs one step a call whatever its hold."""
    async def go() -> None:
        verifier, policy = FakeVerifier(), Recording(drafter, 4 if drafter else 0)
        policy.hold = 3
        sched = scheduler(policy, verifier=verifier, plain_steps=4)
        sched.submit(r := request("p", max_tokens=8))
        await steps(sched)
        assert tokens(events(r)) == expected(r.prompt, 8)
        asked = [t.steps for t in verifier.tasks()]
        assert asked == ([1, 3, 3, 1] if drafter is None else [1] * len(asked))
        assert [o.forwards for o in policy.outcomes] == asked
    asyncio.run(go())
