"""The router's decoding loop: continuous batching over drafters and the verifier.

Every step: admit waiting requests (up to ``max_batch`` running), drop cancelled ones, ask the
policy for each request's drafter and k, draft (prompt lookup here in the router, model drafters
over their streams, concurrently), verify the whole batch in one call (the policy's scoring calls
to drafters run meanwhile), stream the accepted tokens, record statistics. Requests join and leave
between steps. A drafter that fails or stalls costs its requests one step without speculation
(still lossless) and is retried later; finished and cancelled requests are released in every
service that holds them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import grpc

from ..obs import metrics, tracing
from ..policy.base import PROMPT_LOOKUP, Policy, RequestView, StepChoice
from ..rpc.convert import sampling_to_proto
from ..v1 import drafter_pb2, generation_pb2, token_tree_pb2, verifier_pb2
from .admission import KVBudget
from .clients import ServiceDown
from .pool import ReplicaPool
from .config import SchedulerConfig
from .requests import DrafterTally, RouterRequest, TextStream
from .translated import TranslatedDrafters

log = logging.getLogger(__name__)
VERIFIER = "verifier"
PROMPT_SCORE_POSITIONS = 512
"""Prompt positions (its tail) a drafter scores at a request's first step."""


class QueueFull(RuntimeError):
    """The waiting queue is at ``max_queue``."""


@dataclass
class RequestError:
    """Ends a client stream with a status."""

    code: grpc.StatusCode
    message: str


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, verifier: ReplicaPool,
                 drafters: dict[str, ReplicaPool], policy: Policy,
                 decode: Callable[[list[int]], str], eos_id: int | None, store=None,
                 kv: KVBudget | None = None, translators: dict | None = None) -> None:
        self.cfg = cfg
        self.kv = kv or KVBudget(0, 0, 0)
        """The verifier's KV blocks (admission); block size 0 = admit by ``max_batch`` only."""
        self.verifier = verifier
        self.drafters = drafters
        self.translated = TranslatedDrafters(translators)
        """Drafters with another tokenizer: they draft through token translation."""
        self.policy = policy
        self.decode = decode
        self.eos_id = eos_id
        self.store = store
        self.waiting: collections.deque[RouterRequest] = collections.deque()
        self.running: list[RouterRequest] = []
        # Micro-batches ("lanes"): each runs its own draft -> verify loop, so while one waits for
        # the verifier the other can be drafting (SPIN's pipeline). One lane = no pipelining.
        self.lanes: list[list[RouterRequest]] = [[] for _ in range(cfg.micro_batches)]
        self._lane_wake = [asyncio.Event() for _ in self.lanes]
        self._streams: dict[str, TextStream] = {}
        self._release: dict[str, set[str]] = collections.defaultdict(set)
        self._stopping = False
        self._verifier_down_since: float | None = None

    # ---- requests in and out ------------------------------------------------------------------
    def submit(self, req: RouterRequest) -> None:
        if len(self.waiting) >= self.cfg.max_queue:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (limit {self.cfg.max_queue})")
        self._streams[req.request_id] = TextStream(self.decode, req.stop)
        self.waiting.append(req)
        metrics.REQUESTS_WAITING.set(len(self.waiting))
        metrics.PROMPT_TOKENS.inc(len(req.prompt))
        self._admit()

    def cancel(self, req: RouterRequest) -> None:
        """The client went away (cancel or deadline): forget the request, free its caches."""
        if req.finished:
            return
        req.cancelled = True
        if req in self.waiting:  # a preempted one: the services still hold its context
            self._finish(req)
        self._wake_all()

    def _wake_all(self) -> None:
        for event in self._lane_wake:
            event.set()

    def _admit(self) -> None:
        """Move waiting requests into the emptiest lanes while the batch has room and the
        verifier's KV cache has blocks for their contexts (``admission.py``)."""
        while self.waiting and len(self.running) < self.cfg.max_batch:
            blocks = self.kv.try_admit(self.waiting[0].context_len, len(self.running))
            if blocks is None:
                break
            req = self.waiting.popleft()
            req.kv_pending = blocks
            if req.scheduled_at is None:
                req.scheduled_at = time.perf_counter()
                metrics.QUEUE_TIME.observe(req.scheduled_at - req.arrival)
            lane = min(range(len(self.lanes)), key=lambda i: len(self.lanes[i]))
            self.lanes[lane].append(req)
            self.running.append(req)
            self._lane_wake[lane].set()
        metrics.REQUESTS_WAITING.set(len(self.waiting))
        metrics.REQUESTS_RUNNING.set(len(self.running))

    def _unschedule(self, req: RouterRequest) -> None:
        """Take a request out of the batch (finished, failed or preempted)."""
        if req in self.running:
            self.running.remove(req)
        for lane in self.lanes:
            if req in lane:
                lane.remove(req)
        self.kv.verified(req.kv_pending)
        req.kv_pending = 0

    def _preempt(self, req: RouterRequest) -> None:
        """The verifier had no KV blocks for the request this step: it waits at the head of the
        queue (the verifier keeps its context) and is verified again when blocks are free."""
        self._unschedule(req)
        req.preemptions += 1
        self.waiting.appendleft(req)
        metrics.REQUESTS_WAITING.set(len(self.waiting))
        metrics.REQUESTS_RUNNING.set(len(self.running))

    def _finish(self, req: RouterRequest) -> None:
        req.finished = True
        if req in self.waiting:  # cancelled while preempted
            self.waiting.remove(req)
            metrics.REQUESTS_WAITING.set(len(self.waiting))
        self._unschedule(req)
        self._streams.pop(req.request_id, None)
        for service in req.touched | {VERIFIER}:
            self._release[service].add(req.request_id)
        self.policy.release(req.request_id)
        metrics.REQUESTS_RUNNING.set(len(self.running))

    def _fail(self, req: RouterRequest, code: grpc.StatusCode, message: str) -> None:
        metrics.REQUEST_ERRORS.labels(code.name).inc()
        req.out.put_nowait(RequestError(code, message))
        self._finish(req)

    # ---- the loop -------------------------------------------------------------------------------
    async def run(self) -> None:
        await asyncio.gather(*(self._lane_loop(i) for i in range(len(self.lanes))))

    async def _lane_loop(self, i: int) -> None:
        lane, wake = self.lanes[i], self._lane_wake[i]
        while not self._stopping:
            for req in [r for r in lane if r.cancelled]:
                self._finish(req)
            self._admit()
            if not lane:
                if not self.running:
                    await self._flush_releases()
                wake.clear()
                if not lane and not self._stopping:
                    await wake.wait()
                continue
            try:
                await self.step(list(lane))
            except Exception as e:  # a bug must not take the router down with every request
                log.exception("step failed")
                for req in list(lane):
                    self._fail(req, grpc.StatusCode.INTERNAL, f"router step failed: {e}")

    def stop(self) -> None:
        self._stopping = True
        self._wake_all()

    async def step(self, reqs: list[RouterRequest]) -> None:
        """One draft -> verify step of a micro-batch."""
        t0 = time.perf_counter()
        available = {n for n, c in self.drafters.items() if c.available}
        if self.cfg.prompt_lookup:
            available.add(PROMPT_LOOKUP)
        views = [RequestView(r.request_id, r.context_len, len(r.generated),
                             r.max_tokens - len(r.generated), r.sampling.greedy, r.mode,
                             r.drafter, r.k,
                             lookup_match=self.cfg.prompt_lookup and r.lookup_index().has_match())
                 for r in reqs]
        choices = self.policy.choose(views, available)
        prediction = choices.prediction
        tracing.start_steps(reqs, choices)  # no-op unless tracing is on
        trees, draft_s, scoring = await self._draft(reqs, choices)
        t1 = time.perf_counter()
        # scoring calls do not feed this step's trees: they run while the verifier works
        scored = asyncio.gather(*(self._draft_one(n, g) for n, g in scoring.items()))
        tasks = []
        for r in reqs:
            keep = self.verifier.route(r.request_id, r.synced.get(VERIFIER, 0))
            tasks.append(verifier_pb2.VerifyTask(
                request_id=r.request_id, keep=keep, context_delta=r.context_from(keep),
                tree=trees.get(r.request_id), sampling=sampling_to_proto(r.sampling),
                traceparent=r.traceparent, tracestate=r.tracestate))
        release = self._release.pop(VERIFIER, set())
        try:
            resp = await self.verifier.call(verifier_pb2.VerifyRequest(tasks=tasks, release=release),
                                            self.cfg.verify_timeout_s)
            t2 = time.perf_counter()  # the verification alone: scoring calls may still run
        except ServiceDown as e:
            self._release[VERIFIER] |= release
            self._verifier_outage(reqs, str(e))
            await asyncio.sleep(0.1)  # the client retries on its back-off; do not spin meanwhile
            return
        finally:
            await scored  # within the step: a request's release never overtakes its scoring
        self._verifier_down_since = None
        self.kv.report(resp.free_blocks, resp.num_blocks)
        predicted_s = prediction.step_s if prediction is not None else 0.0
        for r, choice, res in zip(reqs, choices, resp.results):
            tree = trees.get(r.request_id)
            # the step's wall time (round trips included) is what the request waited: goodput
            self._apply(r, choice if tree is not None else StepChoice(None), res,
                        len(tree.tokens) if tree is not None else 0, t1 - t0, t2 - t1,
                        predicted_s, len(reqs))
        step_s = time.perf_counter() - t0
        metrics.STEP_SECONDS.observe(step_s)
        metrics.STEP_DRAFT_SECONDS.observe(t1 - t0)
        metrics.STEP_VERIFY_SECONDS.observe(t2 - t1)
        drafting_s = max(draft_s.values(), default=0.0)  # the drafters run concurrently
        metrics.RPC_OVERHEAD_SECONDS.observe(max(0.0, step_s - drafting_s - resp.verify_seconds))
        metrics.BATCH_SIZE.observe(len(reqs))
        if prediction is not None and prediction.step_s > 0:  # round trips included
            metrics.STEP_PREDICTED_SECONDS.observe(prediction.step_s)
            metrics.STEP_PREDICTION_ERROR.observe(
                abs(prediction.step_s - step_s) / max(step_s, 1e-9))
            # the verification's share: the whole step but the drafters' calls (router work too)
            self.policy.observe_step(prediction, draft_s, step_s - drafting_s)

    def _verifier_outage(self, reqs: list[RouterRequest], error: str) -> None:
        now = time.monotonic()
        self._verifier_down_since = self._verifier_down_since or now
        for r in reqs:  # whatever the verifier kept, the next call resends whole contexts
            r.synced.pop(VERIFIER, None)
        if now - self._verifier_down_since > self.cfg.verifier_outage_s:
            for r in reqs:
                self._fail(r, grpc.StatusCode.UNAVAILABLE, f"verifier unreachable: {error}")

    async def _draft(self, reqs: list[RouterRequest], choices: list[StepChoice],
                     ) -> tuple[dict[str, token_tree_pb2.TokenTree], dict[str, float],
                                dict[str, list[tuple[RouterRequest, StepChoice]]]]:
        """Trees per request id (only for requests that got one), draft seconds per drafter, and
        the scoring tasks per model drafter (for the caller to send while verifying)."""
        trees: dict[str, token_tree_pb2.TokenTree] = {}
        seconds: dict[str, float] = {}
        groups: dict[str, list[tuple[RouterRequest, StepChoice]]] = collections.defaultdict(list)
        scoring: dict[str, list[tuple[RouterRequest, StepChoice]]] = collections.defaultdict(list)
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
                found = r.lookup_index().propose(c.k)
                if found:
                    trees[r.request_id] = _chain(found)
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

    async def _draft_one(self, name: str, group: list[tuple[RouterRequest, StepChoice]],
                         ) -> tuple[dict[str, token_tree_pb2.TokenTree], float]:
        tasks = []
        translated = name in self.translated
        for r, c in group:
            if translated:  # context, chain and sampling in the drafter's own tokens
                tasks.append(self.translated.task(self.drafters[name], r, c, name))
                r.touched.add(name)
                continue
            keep = self.drafters[name].route(r.request_id, r.synced.get(name, 0))
            tasks.append(drafter_pb2.DraftTask(request_id=r.request_id, keep=keep,
                                               context_delta=r.context_from(keep), k=c.k,
                                               branching=c.branching,
                                               sampling=sampling_to_proto(r.sampling),
                                               traceparent=r.traceparent, tracestate=r.tracestate,
                                               score=bool(c.score),
                                               score_from=_score_from(r) if c.score else 0,
                                               stop_below=c.stop_below))
            r.synced[name] = r.context_len
            r.touched.add(name)
        release = self._release.pop(name, set())
        try:
            resp = await self.drafters[name].call(
                drafter_pb2.SpeculateRequest(tasks=tasks, release=release), self.cfg.draft_timeout_s)
        except ServiceDown as e:
            log.warning("drafting without %s this step: %s", name, e)
            metrics.DRAFTER_FAILURES.labels(name).inc()
            metrics.DRAFTER_UP.labels(name).set(0)
            self._release[name] |= release
            for r, _ in group:
                r.synced.pop(name, None)  # unknown state: resend the whole context next time
            return {}, 0.0
        metrics.DRAFTER_UP.labels(name).set(1)
        trees = {}
        for (r, c), res in zip(group, resp.results):
            if res.resync:
                r.synced.pop(name, None)
            elif res.score_positions:
                self.policy.observe_score(r.request_id, name, res.score_matches,
                                          res.score_positions)
            elif len(res.tree.tokens):
                tree = self.translated.tree(r, name, res.tree, c.k) if translated else res.tree
                if tree is not None:
                    trees[r.request_id] = tree
        return trees, resp.draft_seconds

    async def _flush_releases(self) -> None:
        """Idle: send release-only batches so services free their caches now."""
        calls = []
        for name, ids in list(self._release.items()):
            client = self.verifier if name == VERIFIER else self.drafters.get(name)
            if not ids or client is None or not client.available:
                continue
            self._release.pop(name)
            batch = (verifier_pb2.VerifyRequest(release=ids) if name == VERIFIER
                     else drafter_pb2.SpeculateRequest(release=ids))
            calls.append(client.call(batch))
        for outcome in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.info("release batch failed: %s", outcome)

    # ---- after verification -----------------------------------------------------------------
    def _apply(self, r: RouterRequest, choice: StepChoice, res: verifier_pb2.VerifyResult,
               drafted: int, draft_s: float, verify_s: float, predicted_s: float = 0.0,
               batch_size: int = 1) -> None:
        """Account one verified step (``drafted`` tree nodes) and stream its tokens, with the
        step's account (``StepInfo``: ``predicted_s`` is the policy's prediction of the batch
        step, 0 = none)."""
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
        r.steps += 1
        name = choice.drafter or ""
        metrics.SPEC_STEPS.labels(name).inc()
        metrics.SPEC_K.labels(name).observe(choice.k if choice.drafter else 0)
        if choice.drafter:
            tally = r.tallies.setdefault(name, DrafterTally())
            tally.steps += 1
            tally.draft_tokens += drafted
            tally.accepted_tokens += res.num_accepted
            metrics.SPEC_DRAFTS.labels(name).inc()
            metrics.SPEC_DRAFT_TOKENS.labels(name).inc(drafted)
            metrics.SPEC_ACCEPTED.labels(name).inc(res.num_accepted)
            for pos in range(1, res.num_accepted + 1):
                metrics.SPEC_ACCEPTED_POS.labels(name, str(pos)).inc()
            if self.store is not None:
                self.store.record(name, drafted, res.num_accepted, draft_s, verify_s)
        else:
            r.steps_off += 1
        step = generation_pb2.StepInfo(
            drafter=name, k=choice.k if choice.drafter else 0, draft_tokens=drafted,
            accepted_tokens=res.num_accepted, step_seconds=draft_s + verify_s,
            predicted_step_seconds=predicted_s, batch_size=batch_size)
        if choice.drafter and not choice.branching and 0 < drafted < choice.k:
            choice = replace(choice, k=drafted)  # a chain that stopped early (stop_below)
        self.policy.observe(r.request_id, choice, res.num_accepted, draft_s, verify_s)
        self._emit(r, list(res.tokens), step)

    def _emit(self, r: RouterRequest, tokens: list[int], step: generation_pb2.StepInfo) -> None:
        now = time.perf_counter()
        start = len(r.generated)
        finish = generation_pb2.FINISH_REASON_UNSPECIFIED
        for tok in tokens:
            r.generated.append(tok)
            if len(r.generated) >= r.max_tokens:
                finish = generation_pb2.FINISH_REASON_LENGTH
                break
            if tok == self.eos_id and not r.ignore_eos:
                finish = generation_pb2.FINISH_REASON_STOP
                break
        text, hit = self._streams[r.request_id].push(r.generated, final=bool(finish))
        if hit:
            finish = generation_pb2.FINISH_REASON_STOP
        msg = generation_pb2.GenerateResponse(request_id=r.request_id,
                                              token_ids=r.generated[start:], text=text, step=step)
        metrics.GENERATION_TOKENS.inc(len(r.generated) - start)
        if r.first_token_at is None:
            r.first_token_at = now
            metrics.TTFT.observe(now - r.arrival)
        else:
            metrics.ITL.observe(now - r.last_token_at)
        r.last_token_at = now
        if finish:
            msg.finish_reason = finish
            msg.usage.prompt_tokens = len(r.prompt)
            msg.usage.completion_tokens = len(r.generated)
            s = msg.speculation
            s.steps, s.steps_without_speculation = r.steps, r.steps_off
            s.draft_tokens, s.accepted_tokens = r.draft_tokens, r.accepted_tokens
            s.tau = len(r.generated) / r.steps if r.steps else 0.0
            for name, t in sorted(r.tallies.items()):
                s.drafters.add(drafter=name, steps=t.steps, draft_tokens=t.draft_tokens,
                               accepted_tokens=t.accepted_tokens)
            metrics.E2E.observe(now - r.arrival)
            if len(r.generated) > 1:
                metrics.TPOT.observe((now - r.first_token_at) / (len(r.generated) - 1))
            metrics.REQUEST_SUCCESS.labels(
                "length" if finish == generation_pb2.FINISH_REASON_LENGTH else "stop").inc()
            r.out.put_nowait(msg)
            self._finish(r)
        else:
            r.out.put_nowait(msg)


def _score_from(r: RouterRequest) -> int:
    """First context position a drafter scores: the output, or the prompt before there is any
    (how well a drafter predicts the prompt ranks the drafters' fit to the request)."""
    return len(r.prompt) if r.generated else max(1, len(r.prompt) - PROMPT_SCORE_POSITIONS)


def _chain(tokens: list[int]) -> token_tree_pb2.TokenTree:
    return token_tree_pb2.TokenTree(tokens=tokens, parents=range(-1, len(tokens) - 1))
