"""The router's decoding step, over engine types: choose -> draft -> verify -> apply.

Every step of a micro-batch: ask the policy for each request's drafter and k (a ``StepPlan``),
draft (every proposer of the plan at once: ``proposers.py``), verify the whole micro-batch in one
call (the proposers that score requests for the policy run meanwhile), then apply each verdict:
stream its tokens, requeue a preempted request, and build the step's one record,
``policy.outcome.StepOutcome``, which the policy and the accounting each read once; requests
that finished are then released. Requests join and leave between steps (continuous batching),
admitted by the batch's room and the verifier's KV blocks (``admission.py``).

What each service holds of each request's context, and what it must free, is the services' own
record (``pool.py``): a task sends the ``keep`` it gives and the tokens after it; a service that
answers *resync* gets the whole context next time; a finished or cancelled request is released
in every service, riding along with its next call (or sent alone when the router idles). A
drafter that fails or stalls costs its requests one step without speculation (still lossless);
a verifier that stays unreachable fails its requests after ``verifier_outage_s``.

Where the rest lives: the lanes (micro-batches in flight) and their loop in ``pipeline.py``; the
services' calls in ``services.py`` (the one place tasks and trees become wire messages);
metrics, statistics and ``StepInfo`` in ``accounting.py``; the client's stream (text, stop
strings, finish, usage) in ``streaming.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from ..engine.tree import TokenTree
from ..obs import tracing
from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..policy.base import Policy, RequestView, StepChoice, StepPlan
from ..policy.outcome import RequestOutcome, Score, StepOutcome, outcome
from ..stats.store import StatsStore
from .accounting import Accounting, StepInfo
from .admission import KVBudget
from .config import SchedulerConfig
from .pipeline import Pipeline
from .proposers import Group, Proposals, Proposer
from .requests import RequestStatus, RouterRequest
from .services import ServiceDown, Verifier, VerifyReply, VerifyResult, VerifyTask
from .step_trace import StepTrace
from .structured import constrain
from .streaming import ErrorCode, Streamer

log = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``."""


class Scheduler:
    """The waiting queue, the running batch and the step; ``run`` steps its lanes."""

    def __init__(self, cfg: SchedulerConfig, verifier: Verifier,
                 proposers: Mapping[str, Proposer], policy: Policy,
                 decode: Callable[[list[int]], str], eos_id: int | None,
                 store: StatsStore | None = None, kv: KVBudget | None = None) -> None:
        self.cfg = cfg
        self.kv = kv or KVBudget(0, 0, 0)
        """The verifier's KV blocks (admission); block size 0 = admit by ``max_batch`` only."""
        self.verifier = verifier
        self.proposers = proposers
        """Drafter name -> its proposer (``proposers.Proposers``: a live view, discovery adds
        and removes drafters)."""
        self.policy = policy
        self.accounting = Accounting(store)
        self.trace = StepTrace(cfg.step_trace) if cfg.step_trace else None
        self.stream = Streamer(decode, eos_id, jump_forward=cfg.grammar_drafts)
        self.pipeline = Pipeline(cfg.micro_batches)
        self.waiting: collections.deque[RouterRequest] = collections.deque()
        self.running: list[RouterRequest] = []
        self._verifier_down_since: float | None = None

    # ---- requests in and out ------------------------------------------------------------------
    def submit(self, req: RouterRequest) -> None:
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (limit {self.cfg.max_queue})")
        self.stream.open(req)
        self.waiting.append(req)
        self.accounting.submitted(req)
        self.admit()

    def cancel(self, req: RouterRequest) -> None:
        """The client went away (cancel or deadline): forget the request, free its caches."""
        if req.finished:
            return
        req.cancelled = True
        if req in self.waiting:  # a preempted one: the services still hold its context
            self._finish(req)
        self.pipeline.wake_all()

    def admit(self) -> None:
        """Move waiting requests into the lanes while the batch has room and the verifier's KV
        cache has blocks for their contexts (``admission.py``)."""
        while self.waiting and len(self.running) < self.cfg.max_batch:
            first = self.waiting[0]
            cached = self.verifier.cached_prefix(first.prompt)
            blocks = self.kv.try_admit(first.context_len, len(self.running), cached)
            if blocks is None:
                break
            req = self.waiting.popleft()
            req.kv_pending, req.cached = blocks, cached
            req.status = RequestStatus.RUNNING
            self.accounting.scheduled(req)
            self.running.append(req)
            self.pipeline.place(req)
        self.accounting.queues(len(self.waiting), len(self.running))

    def _unschedule(self, req: RouterRequest) -> None:
        """Take a request out of the batch (finished, failed or preempted)."""
        if req in self.running:
            self.running.remove(req)
        self.pipeline.remove(req)
        self.kv.verified(req.kv_pending)
        req.kv_pending = 0

    def _preempt(self, req: RouterRequest) -> None:
        """The verifier had no KV blocks for the request this step: it waits at the head of the
        queue (the verifier keeps its context) and is verified again when blocks are free."""
        self._unschedule(req)
        req.tally.preemptions += 1
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.accounting.queues(len(self.waiting), len(self.running))

    def _finish(self, req: RouterRequest) -> None:
        """Done: out of the queues, its stream closed, released in every service and the
        policy."""
        req.status = RequestStatus.FINISHED
        if req in self.waiting:  # cancelled while preempted
            self.waiting.remove(req)
        self._unschedule(req)
        self.stream.close(req)
        self.verifier.release([req.request_id])
        for name in list(self.proposers):
            self.proposers[name].seen(req)  # its last tokens, for a proposer that learns them
            self.proposers[name].release(req.request_id)
        self.policy.release(req.request_id)
        self.accounting.queues(len(self.waiting), len(self.running))

    def _fail(self, req: RouterRequest, code: ErrorCode, message: str) -> None:
        self.accounting.failed(code)
        self.stream.fail(req, code, message)
        self._finish(req)

    # ---- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        """Step every lane (``pipeline.py``) until ``stop``."""
        await self.pipeline.run(self._tidy, self._idle, self._step_lane)

    def stop(self) -> None:
        self.pipeline.stop()
        if self.trace is not None:
            self.trace.close()

    def _tidy(self, lane: list[RouterRequest]) -> None:
        for req in [r for r in lane if r.cancelled]:
            self._finish(req)
        self.admit()

    async def _idle(self) -> None:
        """No request runs: send the releases still pending, so services free their caches."""
        if self.running:
            return
        services = [self.verifier, *(self.proposers[n] for n in list(self.proposers))]
        await asyncio.gather(*(s.flush() for s in services if s.pending_releases))

    async def _step_lane(self, reqs: list[RouterRequest]) -> None:
        try:
            await self.step(reqs)
        except Exception as e:  # a bug must not take the router down with every request
            log.exception("step failed")
            for req in reqs:
                if req in self.running:
                    self._fail(req, "internal", f"router step failed: {e}")

    async def step(self, reqs: list[RouterRequest]) -> None:
        """One choose -> draft -> verify -> apply step of a micro-batch."""
        t0 = time.perf_counter()
        available = {n for n in list(self.proposers) if self.proposers[n].available}
        heads = frozenset(n for n in available if self.proposers[n].in_verifier)
        plan = self.policy.choose([self._view(r) for r in reqs], available, heads)
        tracing.start_steps(reqs, plan)  # no-op unless tracing is on
        drafts = await self._call(self._groups(reqs, plan), "propose")
        trees = {rid: t for p in drafts.values() for rid, t in p.trees.items()}
        asks = {rid: a for p in drafts.values() for rid, a in p.asks.items()}
        t1 = time.perf_counter()
        # scoring calls do not feed this step's trees: they run while the verifier works
        scoring = asyncio.ensure_future(self._call(self._scorers(reqs, plan), "score"))
        allowed = constrain(reqs, trees, asks)  # structured output: the grammar's rows
        plain_steps = self._plain_steps(reqs, plan, trees or asks or allowed)
        eos = self.stream.eos_id
        tasks = []
        for r in reqs:
            keep = self.verifier.keep(r.request_id, r.prompt)
            tasks.append(VerifyTask(r.request_id, keep, r.context_from(keep),
                                    trees.get(r.request_id), r.sampling, r.traceparent,
                                    r.tracestate, r.params.logprobs, asks.get(r.request_id),
                                    allowed.get(r.request_id),
                                    # a first step alone: its token is the time to first token
                                    min(plain_steps, r.remaining) if r.generated else 1,
                                    () if eos is None or r.params.ignore_eos else (eos,)))
        reply: VerifyReply | None = None
        try:
            reply = await self.verifier.verify(tasks, self.cfg.verify_timeout_s)
        except ServiceDown as e:
            self._verifier_outage(reqs, str(e))
        finally:  # within the step: a request's release never overtakes its scoring
            t2 = time.perf_counter()  # the verification alone: scoring calls may still run
            scored = await scoring
        scores: dict[str, list[Score]] = collections.defaultdict(list)
        for p in scored.values():
            for rid, sc in p.scores.items():
                scores[rid].append(sc)
        called = {n: not p.failed for calls in (drafts, scored) for n, p in calls.items()
                  if p.remote}
        if reply is not None:
            by_id = {res.request_id: res for res in reply.results}
            for name, p in drafts.items():
                if (proposer := self.proposers.get(name)) is not None:
                    proposer.verified({rid: by_id[rid] for rid in p.asks if rid in by_id})
        # nothing to calibrate on: no reply, or several forwards a request
        multi = any(t.steps > 1 for t in tasks)
        prediction = plan.prediction if reply is not None and not multi else None
        head_s = reply.head_seconds if reply is not None else {}  # inside the verifier's time
        step = StepOutcome((), prediction, t1 - t0, t2 - t1, 0.0,
                           {n: head_s.get(n, p.seconds) for n, p in drafts.items()},
                           reply.verify_seconds - sum(head_s.values()) if reply is not None
                           else 0.0, called, max(t.steps for t in tasks))
        self._apply(reqs, plan, reply, trees, {rid for rid, a in asks.items() if a.k > 0},
                    scores, step, t0)
        if reply is None:
            await asyncio.sleep(0.1)  # the client retries on its back-off; do not spin meanwhile

    def _plain_steps(self, reqs: list[RouterRequest], plan: StepPlan, drafting: object) -> int:
        """Plain steps this lane's verification call runs (``SchedulerConfig.plain_steps``):
        more than one only when none drafts (``drafting`` falsy: a head's ask), no request has a
        grammar or waits for admission (the call holds the lane), and either every request has
        speculation off or the policy's plan, in which none drafts or scores, holds that long
        (``StepPlan.hold``: the loss guard's plain steps until its next probe)."""
        if self.cfg.plain_steps <= 1 or drafting or self.waiting:
            return 1
        if any(r.constraint is not None for r in reqs):
            return 1
        if all(r.params.mode == "off" for r in reqs):
            return self.cfg.plain_steps
        if any(c.drafter is not None or c.score for c in plan):
            return 1
        return max(1, min(plan.hold, self.cfg.plain_steps))

    def _view(self, r: RouterRequest) -> RequestView:
        """What the policy may know of ``r`` (whether each model-free proposer would draft: they
        look first)."""
        p = r.params
        free = {n: q.matches(r) for n in self.proposers if (q := self.proposers[n]).model_free}
        lookup = free.pop(PROMPT_LOOKUP, 0)
        return RequestView(r.request_id, r.context_len, len(r.generated), r.remaining,
                           r.sampling.greedy, p.mode, p.drafter, p.k, p.early_stop,
                           lookup_match=lookup > 0, lookup_branches=max(lookup, 1),
                           free_branches=tuple(free.items()), cached=r.cached)

    def _verifier_outage(self, reqs: list[RouterRequest], error: str) -> None:
        now = time.monotonic()
        self._verifier_down_since = self._verifier_down_since or now
        for r in reqs:  # whatever the verifier kept, the next call resends whole contexts
            self.verifier.forget(r.request_id)
        if now - self._verifier_down_since > self.cfg.verifier_outage_s:
            for r in reqs:
                self._fail(r, "unavailable", f"verifier unreachable: {error}")

    # ---- proposers -------------------------------------------------------------------------------
    def _groups(self, reqs: list[RouterRequest], plan: StepPlan) -> dict[str, Group]:
        """Requests per proposer that drafts for them, and every proposer with releases to send
        (they ride along with a call)."""
        groups: dict[str, Group] = collections.defaultdict(list)
        for r, c in zip(reqs, plan):
            if c.drafter is not None and c.k > 0 and c.drafter in self.proposers:
                groups[c.drafter].append((r, c))
        for name in list(self.proposers):
            p = self.proposers[name]
            if name not in groups and p.pending_releases and p.available:
                groups[name] = []
        return groups

    def _scorers(self, reqs: list[RouterRequest], plan: StepPlan) -> dict[str, Group]:
        """Requests per proposer that scores them (the policy's probe of how well each drafter
        predicts a request); a request's own drafter this step measures itself for real."""
        groups: dict[str, Group] = collections.defaultdict(list)
        for r, c in zip(reqs, plan):
            for name in c.score:
                p = self.proposers.get(name)
                if name != c.drafter and p is not None and p.available and p.can_score:
                    groups[name].append((r, c))
        return groups

    async def _call(self, groups: dict[str, Group], what: str) -> dict[str, Proposals]:
        """Each proposer's ``propose`` or ``score`` for its group, all at once."""
        names = list(groups)
        calls = [getattr(self.proposers[n], what)(groups[n], self.cfg.draft_timeout_s)
                 for n in names]
        return dict(zip(names, await asyncio.gather(*calls)))

    # ---- after verification -----------------------------------------------------------------
    def _apply(self, reqs: list[RouterRequest], plan: StepPlan, reply: VerifyReply | None,
               trees: dict[str, TokenTree], asked: set[str], scores: dict[str, list[Score]],
               step: StepOutcome, t0: float) -> None:
        """Apply each verdict (stream its tokens, requeue a preempted request), then hand the
        step's outcome to the policy and the accounting, then finish the requests that are
        done (after the policy saw their last step)."""
        if reply is not None:
            self._verifier_down_since = None
            self.kv.report(reply.free_blocks, reply.num_blocks)
        prefilled = {r.request_id for r in reqs if not r.generated}  # their first step
        results: list[VerifyResult | None] = list(reply.results) if reply is not None else [
            None] * len(reqs)
        outcomes, done = [], []
        for r, choice, res in zip(reqs, plan, results):
            tree = trees.get(r.request_id)
            o = self._outcome(r, choice if tree is not None else StepChoice(None), tree, res,
                              tuple(scores.get(r.request_id, ())))
            if tree is None and r.request_id in asked:
                o = replace(o, asked=True)
            outcomes.append(o)
            if res is not None:
                tracing.end_step(r, o.choice, o.drafted, res)
            if o.verified:
                n, finish = self._emit(r, o, res, StepInfo.of(o, step, len(reqs)))
                outcomes[-1] = replace(o, emitted=n)
                if finish:
                    done.append(r)
        step = replace(step, requests=tuple(outcomes), step_s=time.perf_counter() - t0)
        self.policy.observe(step)
        if reply is not None:
            self.accounting.step(step, self.policy.measured(), self.policy.calibration())
            if self.trace is not None:
                self.trace.write(step, prefilled)
        for r in done:
            self._finish(r)

    def _outcome(self, r: RouterRequest, choice: StepChoice, tree: TokenTree | None,
                 res: VerifyResult | None, scores: tuple[Score, ...]) -> RequestOutcome:
        """``r``'s part of the step; its services' records updated (resync, preemption)."""
        drafted = len(tree) if tree is not None else 0
        base = RequestOutcome(r.request_id, r.sampling.greedy, choice, drafted, scores=scores)
        if res is None or r.cancelled or r.finished:
            return base
        if res.resync:
            self.verifier.forget(r.request_id)
            return base
        self.kv.verified(r.kv_pending)
        r.kv_pending = 0
        if res.preempted:  # the verifier still holds its context: the same keep next time
            self.verifier.hold(r.request_id, r.context_len)
            self._preempt(r)
            return base
        self.verifier.hold(r.request_id, r.context_len + len(res.tokens))
        if choice.drafter and not choice.branching and 0 < drafted < choice.k:
            choice = replace(choice, k=drafted)  # a chain that stopped early (stop_below)
        ranks = (outcome(tree, res.tokens, res.num_accepted)  # what its ranks say (greedy)
                 if tree is not None and r.sampling.greedy else None)
        return replace(base, choice=choice, accepted=res.num_accepted, verified=True,
                       ranks=ranks)

    def _emit(self, r: RouterRequest, o: RequestOutcome, res: VerifyResult,
              info: StepInfo) -> tuple[int, bool]:
        """Count and stream a verified step's tokens: (tokens emitted, the request is done)."""
        if o.choice.drafter is None and not o.drafted:  # one forward per token it emitted
            info = replace(info, forwards=len(res.tokens))
        self.accounting.verified(r, o, info)
        start = len(r.generated)
        chunk = self.stream.emit(r, res.tokens, info, res.logprobs)
        n = len(r.generated) - start
        if not r.sampling.greedy:  # one per generated token, 0 where the verifier sent none
            r.token_probs.extend((res.token_probs[:n] + [0.0] * n)[:n])
        self.accounting.streamed(r, n, chunk.finish)
        return n, chunk.finish is not None
