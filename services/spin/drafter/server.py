"""``spin drafter``: one draft model behind ``spin.v1.Drafter``.

The router streams batches of draft tasks; each task carries only the context delta since the
router last synced this request with this drafter. Compute runs on one worker thread (the event loop
stays free for health checks and other streams); batches from several routers are serialised.
With tracing on, a task carrying a ``traceparent`` gets a ``spin.draft`` span under the router's
step span, and its batch a ``spin.drafter.speculate`` span (``obs/tracing.py``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from ..engine.drafter import DraftRequest, ModelDrafter
from ..engine.model_runner import RunnerConfig, describe
from ..engine.tree import TokenTree
from ..engine.vocab import load_identity
from ..obs import metrics, tracing
from ..timing.cost_model import DraftSample
from ..rpc.batches import in_order
from ..rpc.convert import sampling_from_proto, tree_to_proto
from ..rpc.decode import add_servicer
from ..rpc.model_info import model_info
from ..rpc.serving import ServerConfig, announce, serve, torch_worker
from ..rpc.step_times import StepTimesMode, drafter_times, to_proto
from ..v1 import drafter_pb2, drafter_pb2_grpc, model_info_pb2

log = logging.getLogger(__name__)


class DrafterService(drafter_pb2_grpc.DrafterServicer):
    """A ``ModelDrafter`` with per-request contexts."""

    def __init__(self, name: str, model_path: str | Path,
                 runner: RunnerConfig = RunnerConfig(),
                 worker: ThreadPoolExecutor | None = None) -> None:
        """``worker``: the one thread batches compute on (``rpc.serving.torch_worker``;
        default a new one)."""
        self.name = name
        self.model_path = str(model_path)
        self.quantized = runner.quantize != "none"
        self.tokenizer = load_identity(model_path)
        limit = self.tokenizer.size if self.tokenizer is not None else None
        self.drafter = ModelDrafter(name, runner.load(model_path, vocab_limit=limit))
        self._pool = worker or ThreadPoolExecutor(1, thread_name_prefix=f"drafter-{name}")
        metrics.NUM_PREEMPTIONS.labels("drafter", name)  # exported at 0 from the start
        self.step_times: list[DraftSample] = []
        """Draft calls this drafter timed on itself, reported in its model info."""

    def info(self) -> model_info_pb2.ModelInfo:
        info = model_info(self.name, self.model_path, self.drafter.runner, self.tokenizer)
        info.step_times.extend(to_proto(self.step_times))
        return info

    def measure_step_times(self, mode: StepTimesMode = "auto") -> None:
        """Time this drafter's calls on this process (or load them from an earlier start's
        cache): the routers fit their cost model from them."""
        self.step_times = drafter_times(self.drafter, self.model_path, mode,
                                        quantized=self.quantized)

    async def GetDrafterInfo(self, request, context) -> drafter_pb2.GetDrafterInfoResponse:
        return drafter_pb2.GetDrafterInfoResponse(info=self.info())

    async def Speculate(self, request_iterator: AsyncIterator[drafter_pb2.SpeculateRequest],
                        context: grpc.aio.ServicerContext) -> AsyncIterator[drafter_pb2.SpeculateResponse]:
        async for resp in in_order(request_iterator, self.run_batch, self._pool):
            yield resp

    def run_batch(self, batch: drafter_pb2.SpeculateRequest) -> drafter_pb2.SpeculateResponse:
        """Release, update contexts, draft; one result per task, in task order."""
        start, start_ns = time.perf_counter(), time.time_ns()
        for rid in batch.release:
            self.drafter.release(rid)
        results: list[drafter_pb2.DraftResult] = []
        work: list[tuple[int, DraftRequest]] = []
        scoring: list[tuple[int, DraftRequest, int]] = []
        seqs = self.drafter.seqs
        free = self.drafter.runner.cache.blocks.free_seqs
        for task in batch.tasks:
            results.append(drafter_pb2.DraftResult(request_id=task.request_id))
            new = task.request_id not in seqs
            if not seqs.holds(task.request_id, task.keep) or (new and free == 0):
                # not held, or no room to hold it (--max-seqs): the router sends it whole later
                results[-1].resync = True
                metrics.SERVICE_RESYNCS.labels("drafter", self.name).inc()
                continue
            free -= new
            try:
                sampling = sampling_from_proto(task.sampling)
            except ValueError as e:
                log.warning("%s: bad sampling parameters: %s", task.request_id, e)
                continue
            if not (task.keep or task.context_delta) or any(b <= 0 for b in task.branching):
                continue
            score = task.score and task.k <= 0  # a prefill that scores, no draft
            req = DraftRequest(task.request_id, task.context_delta, max(task.k, 0),
                               tuple(task.branching), sampling, task.stop_below, task.keep,
                               tuple(task.context_probs) if score else ())
            if score:
                scoring.append((len(results) - 1, req, task.score_from))
            else:
                work.append((len(results) - 1, req))
        evictions = self.drafter.evictions
        scores = self.drafter.score([r for _, r, _ in scoring], [f for _, _, f in scoring])
        for (i, _, _), sc in zip(scoring, scores):
            results[i].score_matches, results[i].score_positions = sc.matches, sc.positions
            results[i].score_acceptance = sc.accepted
            results[i].score_acceptance_positions = sc.accepted_positions
        if work:  # k = 0 tasks only update the context
            trees: list[TokenTree] = self.drafter.propose([r for _, r in work])
            for (i, _), tree in zip(work, trees):
                results[i].tree.CopyFrom(tree_to_proto(tree))
        if self.drafter.evictions > evictions:
            metrics.NUM_PREEMPTIONS.labels("drafter", self.name).inc(
                self.drafter.evictions - evictions)
        seconds = time.perf_counter() - start
        runner = self.drafter.runner
        metrics.observe_service_batch("drafter", self.name, seconds, len(batch.tasks),
                                      runner.cache.usage, len(self.drafter.seqs),
                                      runner.cache.blocks.prefix)
        if tracing.enabled():
            self._trace(batch, results, start_ns, start_ns + int(seconds * 1e9))
        blocks = runner.cache.blocks
        return drafter_pb2.SpeculateResponse(batch_id=batch.batch_id, results=results,
                                              draft_seconds=seconds,
                                              free_blocks=blocks.free_blocks,
                                              num_blocks=blocks.num_blocks)

    def _trace(self, batch: drafter_pb2.SpeculateRequest, results: list[drafter_pb2.DraftResult],
               start_ns: int, end_ns: int) -> None:
        """Spans of the batch's traced tasks (those of sampled requests) and of the batch."""
        tracing.record_batch(
            "spin.drafter.speculate", "spin.draft", start_ns, end_ns,
            {"spin.drafter": self.name, "spin.batch_id": batch.batch_id,
             "spin.batch_size": len(batch.tasks)},
            ((t.traceparent, t.tracestate,
              {"spin.request_id": t.request_id, "spin.k": t.k, "spin.tree_size": len(r.tree.tokens),
               "spin.context_delta": len(t.context_delta), "spin.resync": r.resync})
             for t, r in zip(batch.tasks, results) if t.traceparent))


def run(model: str, name: str | None, cfg: ServerConfig,
        runner: RunnerConfig = RunnerConfig(), step_times: StepTimesMode = "auto") -> None:
    """Load the model, time its draft calls, then serve until SIGTERM."""
    name = name or Path(model).name
    worker = torch_worker(f"drafter-{name}")

    def start() -> DrafterService:
        service = DrafterService(name, model, runner, worker)
        log.info("drafter %s %s", name, describe(service.drafter.runner))
        service.drafter.runner.capture_graphs(progress=True)  # before timing: as served
        service.measure_step_times(step_times)
        return service

    service = worker.submit(start).result()
    service_descriptor = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"]
    cfg.service_names = [service_descriptor.full_name]
    cfg.trace_service = f"spin-drafter-{name}"
    # requests that do not parse end their stream INVALID_ARGUMENT (rpc/decode.py)
    asyncio.run(serve(cfg, lambda s: add_servicer(service, service_descriptor, s),
                      on_ready=announce(f"drafter {name}")))
