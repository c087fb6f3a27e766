"""The router's decoding step, over engine types: choose -> draft -> verify -> apply.

Every step of a micro-batch: ask the policy for each request's drafter and k (a ``StepPlan``),
draft (prompt lookup here in the router, model drafters over their services, concurrently), verify
the whole micro-batch in one call (the policy's scoring calls to drafters run meanwhile), then
apply each verdict: account it, stream its tokens, finish the request or requeue a preempted one.
Requests join and leave between steps (continuous batching), admitted by the batch's room and
the verifier's KV blocks (``admission.py``).

Each service holds each request's context: a task sends ``keep`` (what the service holds of it,
``r.synced``) and the tokens after it; a service that answers *resync* gets the whole context
next time. Finished and cancelled requests are released in every service that holds them, the
releases riding along with the next call to that service (or sent alone when the router idles).
A drafter that fails or stalls costs its requests one step without speculation (still lossless);
a verifier that stays unreachable fails its requests after ``verifier_outage_s``.

Where the rest lives: the lanes (micro-batches in flight) and their loop in ``pipeline.py``; the
services' calls in ``services.py`` (the one place tasks and trees become wire messages);
metrics, statistics and ``StepInfo`` in ``accounting.py``; the client's stream (text, stop
strings, finish, usage) in ``streaming.py``; drafters with another tokenizer in ``translated.py``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

from ..engine.prompt_lookup import lookup_tree
from ..engine.translate import Translator
from ..engine.tree import TokenTree
from ..obs import tracing
from ..policy.base import PROMPT_LOOKUP, Policy, RequestView, StepChoice, StepPrediction
from ..policy.tree_choice import outcome
from ..stats.store import StatsStore
from .accounting import Accounting
from .admission import KVBudget
from .config import SchedulerConfig
from .pipeline import Pipeline
from .requests import RouterRequest
from .services import (DraftTask, Drafter, ServiceDown, Verifier, VerifyReply, VerifyResult,
                       VerifyTask)
from .streaming import ErrorCode, Streamer
from .translated import TranslatedDrafters

log = logging.getLogger(__name__)
VERIFIER = "verifier"
PROMPT_SCORE_POSITIONS = 512
"""Prompt positions (its tail) a drafter scores at a request's first step."""
Group = list[tuple[RouterRequest, StepChoice]]


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``."""


class Scheduler:
    """The waiting queue, the running batch and the step; ``run`` steps its lanes."""

    def __init__(self, cfg: SchedulerConfig, verifier: Verifier, drafters: Mapping[str, Drafter],
                 policy: Policy, decode: Callable[[list[int]], str], eos_id: int | None,
                 store: StatsStore | None = None, kv: KVBudget | None = None,
                 translators: dict[str, Translator] | None = None) -> None:
        self.cfg = cfg
        self.kv = kv or KVBudget(0, 0, 0)
        """The verifier's KV blocks (admission); block size 0 = admit by ``max_batch`` only."""
        self.verifier = verifier
        self.drafters = drafters
        """Drafter name -> its service (a live view: discovery adds and removes drafters)."""
        self.translated = TranslatedDrafters(translators)
        """Drafters with another tokenizer: they draft through token translation."""
        self.policy = policy
        self.accounting = Accounting(store)
        self.stream = Streamer(decode, eos_id)
        self.pipeline = Pipeline(cfg.micro_batches)
        self.waiting: collections.deque[RouterRequest] = collections.deque()
        self.running: list[RouterRequest] = []
        self._release: dict[str, set[str]] = collections.defaultdict(set)
        """Service key -> request ids to release there with its next call."""
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
            blocks = self.kv.try_admit(self.waiting[0].context_len, len(self.running))
            if blocks is None:
                break
            req = self.waiting.popleft()
            req.kv_pending = blocks
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
        req.preemptions += 1
        self.waiting.appendleft(req)
        self.accounting.queues(len(self.waiting), len(self.running))

    def _finish(self, req: RouterRequest) -> None:
        req.finished = True
        if req in self.waiting:  # cancelled while preempted
            self.waiting.remove(req)
        self._unschedule(req)
        self.stream.close(req)
        for service in req.touched | {VERIFIER}:
            self._release[service].add(req.request_id)
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

    def _tidy(self, lane: list[RouterRequest]) -> None:
        for req in [r for r in lane if r.cancelled]:
            self._finish(req)
        self.admit()

    async def _idle(self) -> None:
        if not self.running:
            await self._flush_releases()

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
        available = {n for n, c in self.drafters.items() if c.available}
        if self.cfg.prompt_lookup:
            available.add(PROMPT_LOOKUP)
        plan = self.policy.choose([self._view(r) for r in reqs], available)
        tracing.start_steps(reqs, plan)  # no-op unless tracing is on
        trees, draft_s, scoring = await self._draft(reqs, plan)
        t1 = time.perf_counter()
        # scoring calls do not feed this step's trees: they run while the verifier works
        scored = asyncio.gather(*(self._draft_one(n, g) for n, g in scoring.items()))
        tasks = []
        for r in reqs:
            keep = self.verifier.route(r.request_id, r.synced.get(VERIFIER, 0))
            tasks.append(VerifyTask(r.request_id, keep, r.context_from(keep),
                                    trees.get(r.request_id), r.sampling, r.traceparent,
                                    r.tracestate, r.logprobs))
        release = self._release.pop(VERIFIER, set())
        try:
            reply = await self.verifier.verify(tasks, release, self.cfg.verify_timeout_s)
            t2 = time.perf_counter()  # the verification alone: scoring calls may still run
        except ServiceDown as e:
            self._release[VERIFIER] |= release
            self._verifier_outage(reqs, str(e))
            await asyncio.sleep(0.1)  # the client retries on its back-off; do not spin meanwhile
            return
        finally:
            await scored  # within the step: a request's release never overtakes its scoring
        self._verifier_down_since = None
        self.kv.report(reply.free_blocks, reply.num_blocks)
        prediction = plan.prediction
        predicted_s = prediction.step_s if prediction is not None else 0.0
        for r, choice, res in zip(reqs, plan, reply.results):
            tree = trees.get(r.request_id)
            # the step's wall time (round trips included) is what the request waited: goodput
            self._apply(r, choice if tree is not None else StepChoice(None), res, tree,
                        t1 - t0, t2 - t1, predicted_s, len(reqs))
        self._account_step(len(reqs), reply, draft_s, t0, t1, t2, prediction)

    def _view(self, r: RouterRequest) -> RequestView:
        """What the policy may know of ``r`` (whether prompt lookup would draft: it looks first)."""
        lookup = self.cfg.prompt_lookup and r.lookup_index().has_match()
        return RequestView(r.request_id, r.context_len, len(r.generated),
                           r.max_tokens - len(r.generated), r.sampling.greedy, r.mode, r.drafter,
                           r.k, r.early_stop, lookup_match=lookup,
                           lookup_branches=1 + bool(lookup and r.lookup_index().alternative(1)))

    def _account_step(self, batch_size: int, reply: VerifyReply, draft_s: dict[str, float],
                      t0: float, t1: float, t2: float, prediction: StepPrediction | None) -> None:
        step_s = time.perf_counter() - t0
        self.accounting.step(batch_size, t1 - t0, t2 - t1, step_s, draft_s, reply.verify_seconds,
                             prediction)
        if prediction is not None and prediction.step_s > 0:
            # the verification's share: the whole step but the drafters' calls (router work too)
            drafting_s = max(draft_s.values(), default=0.0)
            self.policy.observe_step(prediction, draft_s, step_s - drafting_s)

    def _verifier_outage(self, reqs: list[RouterRequest], error: str) -> None:
        now = time.monotonic()
        self._verifier_down_since = self._verifier_down_since or now
        for r in reqs:  # whatever the verifier kept, the next call resends whole contexts
            r.synced.pop(VERIFIER, None)
        if now - self._verifier_down_since > self.cfg.verifier_outage_s:
            for r in reqs:
                self._fail(r, "unavailable", f"verifier unreachable: {error}")

    # ---- drafting -------------------------------------------------------------------------------
    async def _draft(self, reqs: list[RouterRequest], choices: list[StepChoice],
                     ) -> tuple[dict[str, TokenTree], dict[str, float], dict[str, Group]]:
        """Trees per request id (only for requests that got one), draft seconds per drafter, and
        the scoring tasks per model drafter (for the caller to send while verifying)."""
        trees: dict[str, TokenTree] = {}
        seconds: dict[str, float] = {}
        groups: dict[str, Group] = collections.defaultdict(list)
        scoring: dict[str, Group] = collections.defaultdict(list)
        for r, c in zip(reqs, choices):
            for name in c.score:  # the policy's probe of how well each drafter predicts r
                if name == c.drafter:
                    continue  # this step measures it for real
                if name == PROMPT_LOOKUP:  # like a drafter: only the tokens since the last round
                    start = max(len(r.prompt), r.lookup_scored)
                    r.lookup_scored = r.context_len
                    self.policy.observe_score(r.request_id, name, *r.lookup_index().score(start))
                elif (name in self.drafters and self.drafters[name].available
                      and name not in self.translated):  # its predictions are in other tokens
                    scoring[name].append((r, StepChoice(name, 0, score=(name,))))
            if c.drafter is None or c.k <= 0:
                continue
            if c.drafter == PROMPT_LOOKUP:  # free: runs here, no round trip
                start = time.perf_counter()
                tree = lookup_tree(r.lookup_index(), c.k, bool(c.branching))
                if tree is not None:
                    trees[r.request_id] = tree
                seconds[PROMPT_LOOKUP] = seconds.get(PROMPT_LOOKUP, 0.0) + time.perf_counter() - start
            elif c.drafter in self.drafters:
                groups[c.drafter].append((r, c))
        names = set(groups) | {n for n, ids in self._release.items()  # releases ride along
                               if ids and n in self.drafters and self.drafters[n].available}
        results = await asyncio.gather(*(self._draft_one(n, groups.get(n, [])) for n in names))
        for name, (got, secs) in zip(names, results):
            trees.update(got)
            seconds[name] = secs
        return trees, seconds, scoring

    async def _draft_one(self, name: str, group: Group) -> tuple[dict[str, TokenTree], float]:
        """One drafter's call for ``group`` (its pending releases ride along): trees per request
        id, and the drafter's seconds; a failed call drafts nothing."""
        drafter = self.drafters[name]
        translated = name in self.translated
        tasks = []
        for r, c in group:
            if translated:  # context, chain and sampling in the drafter's own tokens
                tasks.append(self.translated.task(drafter, r, c, name))
            else:
                keep = drafter.route(r.request_id, r.synced.get(name, 0))
                probs = (r.context_probs_from(keep)
                         if c.score and r.generated and not r.sampling.greedy else [])
                tasks.append(DraftTask(r.request_id, keep, r.context_from(keep), c.k, r.sampling,
                                       c.branching, r.traceparent, r.tracestate, bool(c.score),
                                       _score_from(r) if c.score else 0, c.stop_below, probs))
                r.synced[name] = r.context_len
            r.touched.add(name)
        release = self._release.pop(name, set())
        try:
            reply = await drafter.draft(tasks, release, self.cfg.draft_timeout_s)
        except ServiceDown as e:
            log.warning("drafting without %s this step: %s", name, e)
            self.accounting.drafter_failed(name)
            self._release[name] |= release
            for r, _ in group:
                r.synced.pop(name, None)  # unknown state: resend the whole context next time
            return {}, 0.0
        self.accounting.drafter_answered(name)
        trees = {}
        for (r, c), res in zip(group, reply.results):
            if res.resync:
                r.synced.pop(name, None)
            elif res.score_positions:
                self.policy.observe_score(
                    r.request_id, name, res.score_matches, res.score_positions,
                    res.score_acceptance if res.score_acceptance_positions == res.score_positions
                    else None)
            elif res.tree is not None and len(res.tree):
                tree = self.translated.tree(r, name, res.tree, c.k) if translated else res.tree
                if tree is not None:
                    trees[r.request_id] = tree
        return trees, reply.draft_seconds

    async def _flush_releases(self) -> None:
        """Idle: send release-only calls so services free their caches now."""
        calls = []
        for name, ids in list(self._release.items()):
            service = self.verifier if name == VERIFIER else self.drafters.get(name)
            if not ids or service is None or not service.available:
                continue
            self._release.pop(name)
            calls.append(self.verifier.verify([], ids) if name == VERIFIER
                         else self.drafters[name].draft([], ids))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, Exception):
                log.info("release call failed: %s", result)

    # ---- after verification -----------------------------------------------------------------
    def _apply(self, r: RouterRequest, choice: StepChoice, res: VerifyResult,
               tree: TokenTree | None, draft_s: float, verify_s: float, predicted_s: float,
               batch_size: int) -> None:
        """Account one verified step (its drafted ``tree``, None without one) and stream its
        tokens (``predicted_s``: the policy's prediction of the batch step, 0 = none)."""
        drafted = len(tree) if tree is not None else 0
        tracing.end_step(r, choice, drafted, res)
        if r.cancelled:
            return
        if res.resync:
            r.synced.pop(VERIFIER, None)
            return
        self.kv.verified(r.kv_pending)
        r.kv_pending = 0
        if res.preempted:  # the verifier still holds its context: the same keep next time
            r.synced[VERIFIER] = r.context_len
            self._preempt(r)
            return
        r.synced[VERIFIER] = r.context_len + len(res.tokens)
        step = self.accounting.verified(r, choice, drafted, res.num_accepted, draft_s, verify_s,
                                        predicted_s, batch_size)
        if choice.drafter and not choice.branching and 0 < drafted < choice.k:
            choice = replace(choice, k=drafted)  # a chain that stopped early (stop_below)
        ranks = (outcome(tree, res.tokens, res.num_accepted)  # what its ranks say (greedy)
                 if tree is not None and r.sampling.greedy else None)
        self.policy.observe(r.request_id, choice, res.num_accepted, draft_s, verify_s, ranks)
        start = len(r.generated)
        chunk = self.stream.emit(r, res.tokens, step, res.logprobs)
        if not r.sampling.greedy:  # one per generated token, 0 where the verifier sent none
            n = len(r.generated) - start
            r.token_probs.extend((res.token_probs[:n] + [0.0] * n)[:n])
        self.accounting.streamed(r, len(r.generated) - start, chunk.finish)
        if chunk.finish is not None:
            self._finish(r)


def _score_from(r: RouterRequest) -> int:
    """First context position a drafter scores: the output, or the prompt before there is any
    (how well a drafter predicts the prompt ranks the drafters' fit to the request)."""
    return len(r.prompt) if r.generated else max(1, len(r.prompt) - PROMPT_SCORE_POSITIONS)
