"""``spin verifier``: the target model behind ``spin.v1.Verifier``.

Each task carries the context delta since the router last synced the request (usually nothing: the
verifier appends the tokens it emits itself) and the drafted tree. One target forward scores the
whole batch; the engine's acceptance rule decides. Compute runs on one worker thread; a batch
that arrives while another computes is received and queued behind it (``rpc/batches.py``). With
tracing on, a task carrying a ``traceparent`` gets a ``spin.verify`` span under the router's step
span, and its batch a ``spin.verifier.verify`` span (``obs/tracing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from ..engine.colocated import Colocated, ColocatedDrafter, load_colocated
from ..engine.eagle import EagleHead
from ..engine.head_runner import HeadAsk, HeadRunner
from ..engine.logprobs import MAX_LOGPROBS
from ..engine.model_runner import RunnerConfig, describe
from ..engine import token_mask
from ..engine.tree import TokenTree
from ..engine.verifier import HEAD_WINDOW, PendingStep, Verifier, VerifyRequest
from ..engine.vocab import load_identity
from ..obs import metrics, tracing
from ..timing.cost_model import CostModel, DraftSample, VerifySample
from ..rpc.batches import in_order
from ..rpc.convert import logprobs_to_proto, sampling_from_proto, tree_from_proto
from ..rpc.decode import add_servicer
from ..rpc.model_info import model_info
from ..rpc.serving import ServerConfig, announce, serve, torch_worker
from ..rpc.step_times import (StepTimesMode, drafter_times, head_times, to_proto,
                              verifier_times)
from ..v1 import model_info_pb2, verifier_pb2, verifier_pb2_grpc
from .decompose import GroupCost, decompose, default_cost_model, padded_fraction

log = logging.getLogger(__name__)
MAX_HEAD_K = 16
"""Longest chain a task may ask a head to draft."""
MAX_PLAIN_STEPS = 64
"""Most plain decoding steps one task may ask for (``VerifyTask.steps``)."""


class VerifierService(verifier_pb2_grpc.VerifierServicer):
    """An engine ``Verifier`` with per-request contexts."""

    def __init__(self, model_path: str | Path, runner: RunnerConfig = RunnerConfig(),
                 name: str | None = None, decompose: bool = True,
                 cost_model: CostModel | None = None, heads: dict[str, str] | None = None,
                 head_window: int = HEAD_WINDOW, worker: ThreadPoolExecutor | None = None,
                 colocated: Colocated | None = None) -> None:
        """``heads``: EAGLE-3 draft heads to serve, name -> checkpoint directory; ``worker``:
        the one thread batches compute on (``rpc.serving.torch_worker``; default a new one);
        ``colocated``: draft models to serve inside the verifier."""
        self.model_path = str(model_path)
        self.name = name or Path(model_path).name
        target = runner.load(model_path)
        self.head_paths = dict(heads or {})
        self.verifier = Verifier(target, {n: EagleHead.load(p, len(target.layers))
                                          for n, p in self.head_paths.items()}, head_window)
        self.tokenizer = load_identity(model_path)
        self.colocated = colocated or Colocated()
        for n, p in self.colocated.models.items():
            self.verifier.add_colocated(load_colocated(n, p, target, self.tokenizer,
                                                       self.colocated.runner(runner)))
        self.decompose = decompose
        """Split batches into sub-batches that pad less (``decompose.py``)."""
        self.cost_model = cost_model or default_cost_model()
        """What a decomposition prices its forwards by: a fitted model of the target's forward
        when there is one (``measure_step_times``), else ``decompose.default_cost_model``."""
        self.step_times: list[VerifySample] = []
        """Forwards this verifier timed on itself, reported in its model info."""
        self.head_times: dict[str, list[DraftSample]] = {}
        """Each head's drafts timed on this process, reported in its model info."""
        self._pool = worker or ThreadPoolExecutor(1, thread_name_prefix="verifier")
        self._inflight: list[_PendingBatch] = []
        """Batches queued on the device, not yet finished (worker thread only)."""
        metrics.NUM_PREEMPTIONS.labels("verifier", self.name)  # exported at 0 from the start

    def info(self) -> model_info_pb2.ModelInfo:
        info = model_info(self.name, self.model_path, self.verifier.runner, self.tokenizer)
        info.step_times.extend(to_proto(self.step_times))
        info.heads.extend(sorted(self.verifier.heads))
        for name, samples in sorted(self.head_times.items()):
            info.head_step_times.add(head=name, step_times=to_proto(samples))
        return info

    def measure_step_times(self, mode: StepTimesMode = "auto") -> None:
        """Time the target's forwards on this process (or load them from an earlier start's
        cache): the routers fit their cost model from them, and decomposition prices its
        forwards by them."""
        runner = self.verifier.runner
        self.step_times = verifier_times(runner, self.model_path, mode)
        self.head_times = {
            n: head_times(h, runner, self.head_paths[n], mode) if isinstance(h, HeadRunner)
            else drafter_times(h.drafter, self.colocated.models[n], mode,
                               quantized=self.colocated.quantize != "none")
            for n, h in self.verifier.heads.items()}
        if self.step_times:
            self.cost_model = CostModel.fit(self.step_times)

    async def GetVerifierInfo(self, request, context) -> verifier_pb2.GetVerifierInfoResponse:
        return verifier_pb2.GetVerifierInfoResponse(info=self.info())

    async def Verify(self, request_iterator: AsyncIterator[verifier_pb2.VerifyRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[verifier_pb2.VerifyResponse]:
        try:
            async for resp in in_order(request_iterator, self.start_batch, self._pool):
                yield resp
        except BatchRejected as e:
            await context.abort(e.code, str(e))

    def start_batch(self, batch: verifier_pb2.VerifyRequest) -> _PendingBatch:
        """Release, sync contexts, queue the verification (``_PendingBatch.finish``: one result
        per task, in task order)."""
        start_ns = time.time_ns()
        try:
            return self._start_batch(batch, start_ns)
        except BatchRejected as e:
            if tracing.enabled():
                self._trace(batch, None, start_ns, e)
            raise

    def run_batch(self, batch: verifier_pb2.VerifyRequest) -> verifier_pb2.VerifyResponse:
        """``start_batch`` and its finish at once."""
        return self.start_batch(batch).finish()

    def _trace(self, batch: verifier_pb2.VerifyRequest, resp: verifier_pb2.VerifyResponse | None,
               start_ns: int, error: BatchRejected | None = None) -> None:
        """Spans of the batch's traced tasks (those of sampled requests) and of the batch."""
        results = (resp.results if resp is not None  # rejected: no results, the error says why
                   else [verifier_pb2.VerifyResult()] * len(batch.tasks))
        tracing.record_batch(
            "spin.verifier.verify", "spin.verify", start_ns, time.time_ns(),
            {"spin.model": self.name, "spin.batch_id": batch.batch_id,
             "spin.batch_size": len(batch.tasks)},
            ((t.traceparent, t.tracestate,
              {"spin.request_id": t.request_id, "spin.tree_size": len(t.tree.tokens),
               "spin.accepted": r.num_accepted, "spin.tokens": len(r.tokens),
               "spin.context_delta": len(t.context_delta), "spin.resync": r.resync})
             for t, r in zip(batch.tasks, results) if t.traceparent), error)

    def _start_batch(self, batch: verifier_pb2.VerifyRequest, start_ns: int) -> _PendingBatch:
        start = time.perf_counter()
        ids = set(batch.release) | {t.request_id for t in batch.tasks}
        named = [i for i, x in enumerate(self._inflight) if ids & x.ids]
        for x in self._inflight[:named[-1] + 1] if named else []:
            x.finish()  # a request of a batch still on the device: that batch finishes first
        for rid in batch.release:
            self.verifier.release(rid)
        runner, seqs = self.verifier.runner, self.verifier.seqs
        blocks = runner.cache.blocks
        results: list[verifier_pb2.VerifyResult] = []
        work: list[tuple[int, VerifyRequest]] = []
        more: dict[int, verifier_pb2.VerifyTask] = {}  # result index -> a multi-step task
        new = sum(1 for t in batch.tasks if t.request_id not in seqs
                  and t.keep == 0)  # keep > 0 for an unknown request is a resync
        if new > blocks.free_seqs:
            raise BatchRejected(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{new} new requests but room for {blocks.free_seqs} more "
                                f"(--max-seqs {blocks.max_seqs})")
        for task in batch.tasks:
            results.append(verifier_pb2.VerifyResult(request_id=task.request_id))
            if not seqs.holds(task.request_id, task.keep) or not (task.keep or task.context_delta):
                results[-1].resync = True
                metrics.SERVICE_RESYNCS.labels("verifier", self.name).inc()
                continue
            try:
                sampling = sampling_from_proto(task.sampling)
                tree = tree_from_proto(task.tree, runner.vocab_size, runner.device)
            except ValueError as e:
                raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{task.request_id}: {e}") from e
            if task.keep + len(task.context_delta) >= runner.max_len:
                raise BatchRejected(grpc.StatusCode.OUT_OF_RANGE,
                                    f"{task.request_id}: context of "
                                    f"{task.keep + len(task.context_delta)} tokens is full "
                                    f"(--max-model-len {runner.max_len})")
            logprobs = task.logprobs if task.HasField("logprobs") else None
            if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
                raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{task.request_id}: logprobs must be in [0, {MAX_LOGPROBS}],"
                                    f" got {logprobs}")
            req = VerifyRequest(task.request_id, task.context_delta, tree, sampling,
                                keep=task.keep, logprobs=logprobs,
                                head=self._head_ask(task, tree), allowed=_allowed(task, len(tree)))
            work.append((len(results) - 1, req))
            if _plain_steps(task, req) > 1:
                more[len(results) - 1] = task
        split = _Split(self.cost_model.predict_padded_verify if self.decompose else None)
        step = self.verifier.start([r for _, r in work], split)
        pending = _PendingBatch(self, batch, ids, start, start_ns, work, results, split, step,
                                more)
        self._inflight.append(pending)
        return pending

    def _head_ask(self, task: verifier_pb2.VerifyTask, tree: TokenTree) -> HeadAsk | None:
        """The task's ``HeadAsk`` (``BatchRejected`` for one this verifier cannot serve)."""
        if not task.HasField("head"):
            return None
        h = task.head
        if h.name not in self.verifier.heads:
            raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{task.request_id}: no draft head {h.name!r} (this verifier "
                                f"serves {sorted(self.verifier.heads) or 'none'})")
        if not 0 <= h.k <= MAX_HEAD_K or h.stored not in (0, len(tree)):
            raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{task.request_id}: head k must be in [0, {MAX_HEAD_K}] and "
                                f"stored 0 or the tree's {len(tree)} tokens (got k {h.k}, "
                                f"stored {h.stored})")
        return HeadAsk(h.name, h.k, h.stored)

    def _finish_batch(self, p: _PendingBatch) -> verifier_pb2.VerifyResponse:
        """The batch's response once its verdicts are in (the cache committed)."""
        self._inflight.remove(p)
        batch, results, split = p.batch, p.results, p.split
        runner = self.verifier.runner
        blocks = runner.cache.blocks
        verdicts = p.step.finish()
        if split.sizes:
            metrics.VERIFY_PADDED_FRACTION.observe(padded_fraction(split.sizes, split.groups))
            metrics.VERIFY_FORWARDS.observe(len(split.groups))
        for (i, _), verdict in zip(p.work, verdicts):
            if verdict is None:
                results[i].preempted = True
                metrics.NUM_PREEMPTIONS.labels("verifier", self.name).inc()
                continue
            results[i].tokens.extend(verdict.tokens)
            results[i].num_accepted = verdict.num_accepted
            logprobs_to_proto(verdict.logprobs or (), results[i].logprobs)
            results[i].token_probs.extend(verdict.token_probs or ())
            results[i].head_draft.extend(verdict.head_draft)
        self._more_steps(p)
        seconds = time.perf_counter() - p.start
        metrics.observe_service_batch("verifier", self.name, seconds, len(batch.tasks),
                                      runner.cache.usage, len(self.verifier.seqs),
                                      runner.cache.blocks.prefix)
        resp = verifier_pb2.VerifyResponse(batch_id=batch.batch_id, results=results,
                                           verify_seconds=seconds, free_blocks=blocks.free_blocks,
                                           num_blocks=blocks.num_blocks,
                                           head_seconds=self.verifier.head_seconds)
        if tracing.enabled():
            self._trace(batch, resp, p.start_ns)
        return resp

    @property
    def max_len(self) -> int:
        """The longest context a request may have here (``--max-model-len``)."""
        return self.verifier.runner.max_len

    def _more_steps(self, p: _PendingBatch) -> None:
        """The multi-step tasks' further plain forwards (``VerifyTask.steps``), run together,
        each step's token appended to its result, until every task has its steps, stopped at a
        stop token, filled the context, or was preempted (its tokens so far stand)."""
        going = {i: t for i, t in p.more.items()
                 if p.results[i].tokens and not p.results[i].preempted}
        sampling = {i: req.sampling for i, req in p.work if i in going}

        def held(i: int) -> int:  # the context the verifier holds for task i
            return going[i].keep + len(going[i].context_delta) + len(p.results[i].tokens)

        while going := {i: t for i, t in going.items()
                        if len(p.results[i].tokens) < t.steps and held(i) < self.max_len
                        and p.results[i].tokens[-1] not in t.stop_token_ids}:
            order = list(going)
            reqs = [VerifyRequest(going[i].request_id, (), TokenTree((), ()), sampling[i],
                                  keep=held(i), logprobs=going[i].logprobs
                                  if going[i].HasField("logprobs") else None) for i in order]
            for i, verdict in zip(order, self.verifier.verify(reqs)):
                if verdict is None:  # no room: what it has stands, the next batch resumes
                    metrics.NUM_PREEMPTIONS.labels("verifier", self.name).inc()
                    del going[i]
                    continue
                p.results[i].tokens.extend(verdict.tokens)
                logprobs_to_proto(verdict.logprobs or (), p.results[i].logprobs)
                p.results[i].token_probs.extend(verdict.token_probs or ())


def _plain_steps(task: verifier_pb2.VerifyTask, req: VerifyRequest) -> int:
    """The plain steps ``task`` asks for, ``BatchRejected`` for more than one on a task that
    drafts (a tree, a head or grammar rows: those are decided one step at a time)."""
    if task.steps <= 1:
        return 1
    if task.steps > MAX_PLAIN_STEPS or len(req.tree) or req.head is not None \
            or req.allowed is not None:
        raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{task.request_id}: steps must be in [0, {MAX_PLAIN_STEPS}] and "
                            f"above 1 only for a task without a tree, head or token mask (got "
                            f"{task.steps})")
    return task.steps


@dataclass
class _PendingBatch:
    """A batch whose verification is queued (``Verifier.start``); ``finish`` (idempotent, on
    the service's worker thread) builds its response once the device is done."""

    service: VerifierService
    batch: verifier_pb2.VerifyRequest
    ids: set[str]
    """Its tasks' and releases' request ids (a later batch naming one finishes it first)."""
    start: float
    start_ns: int
    work: list[tuple[int, VerifyRequest]]
    results: list[verifier_pb2.VerifyResult]
    split: _Split
    step: PendingStep
    more: dict[int, verifier_pb2.VerifyTask]
    """Result index -> a task asking for more than one plain step."""
    response: verifier_pb2.VerifyResponse | None = None

    def ready(self) -> bool:
        return self.response is not None or self.step.ready()

    def finish(self) -> verifier_pb2.VerifyResponse:
        if self.response is None:
            self.response = self.service._finish_batch(self)
        return self.response


class _Split:
    """The verifier's split of a batch into forwards (``decompose.py``; one forward without a
    group cost), remembered for the padding metrics."""

    def __init__(self, group_cost: GroupCost | None) -> None:
        self.group_cost = group_cost
        self.sizes: list[tuple[int, int]] = []
        self.groups: list[list[int]] = []

    def __call__(self, sizes: list[tuple[int, int]]) -> list[list[int]]:
        self.sizes = sizes
        self.groups = (decompose(sizes, self.group_cost) if self.group_cost is not None
                       else [list(range(len(sizes)))])
        return self.groups


class BatchRejected(Exception):
    """A batch the verifier cannot run at all (the router sent something it must not)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def run(model: str, cfg: ServerConfig, runner: RunnerConfig = RunnerConfig(),
        decompose: bool = True, step_times: StepTimesMode = "auto",
        heads: dict[str, str] | None = None, head_window: int = HEAD_WINDOW,
        colocated: Colocated | None = None) -> None:
    """Load the target (and its draft heads and colocated drafters), capture its step graphs
    (CUDA), time its forwards, then serve until SIGTERM."""
    worker = torch_worker("verifier")

    def start() -> VerifierService:
        service = VerifierService(model, runner, decompose=decompose, heads=heads,
                                  head_window=head_window, worker=worker, colocated=colocated)
        log.info("verifier %s", describe(service.verifier.runner))
        service.verifier.runner.capture_graphs(progress=True)  # before timing: as served
        for h in service.verifier.heads.values():
            if isinstance(h, ColocatedDrafter):
                h.drafter.runner.capture_graphs(progress=True)
        service.measure_step_times(step_times)
        return service

    service = worker.submit(start).result()
    service_descriptor = verifier_pb2.DESCRIPTOR.services_by_name["Verifier"]
    cfg.service_names = [service_descriptor.full_name]
    cfg.trace_service = "spin-verifier"
    # requests that do not parse end their stream INVALID_ARGUMENT (rpc/decode.py)
    asyncio.run(serve(cfg, lambda s: add_servicer(service, service_descriptor, s),
                      on_ready=announce("verifier")))


def _allowed(task: verifier_pb2.VerifyTask, nodes: int) -> torch.Tensor | None:
    """The task's grammar rows ([nodes + 1, W] int32; None when unset), ``BatchRejected``
    when they are not one row per tree row."""
    if not task.HasField("allowed"):
        return None
    try:
        words = token_mask.from_bytes(task.allowed.bits, task.allowed.words_per_row)
    except ValueError as e:
        raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT, f"{task.request_id}: {e}") from e
    if words.shape[0] != nodes + 1:
        raise BatchRejected(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{task.request_id}: the token mask has {words.shape[0]} rows for "
                            f"a tree of {nodes} nodes (one per node and one after the context)")
    return words
