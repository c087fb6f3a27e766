"""What the router counts: Prometheus metrics, the acceptance statistics store, and each step's
account for the client (``StepInfo``).

The scheduler reports what happened (a request queued, scheduled, verified, streamed, failed; a
batch step's timings; a drafter's call failing or working) and this module turns it into
``obs/metrics.py``'s metrics, ``StatsStore.record`` calls (per drafter, off the decoding path:
the store never blocks) and the per-request tallies the final message reports.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..obs import metrics
from ..policy.base import StepChoice, StepPrediction
from ..stats.store import StatsStore, population_name
from .requests import DrafterTally, RouterRequest


@dataclass(frozen=True)
class StepInfo:
    """The verification step that produced a stream message's tokens (``spin.v1.StepInfo``)."""

    drafter: str
    """The step's drafter; "" = no speculation (the target's own token only)."""
    k: int
    """The k chosen (0 without speculation)."""
    draft_tokens: int
    """Draft tokens sent to the verifier (tree nodes)."""
    accepted_tokens: int
    """Of those, accepted."""
    step_seconds: float
    """The step's draft and verification wall time, round trips included."""
    predicted_step_seconds: float
    """The policy's prediction of the batch step (0 = none)."""
    batch_size: int
    """Requests in the step's micro-batch."""


class Accounting:
    """The router's metrics and statistics; ``store`` None = statistics are not recorded."""

    def __init__(self, store: StatsStore | None = None) -> None:
        self.store = store

    # ---- requests in and out --------------------------------------------------------------------
    def submitted(self, r: RouterRequest) -> None:
        metrics.PROMPT_TOKENS.inc(len(r.prompt))

    def queues(self, waiting: int, running: int) -> None:
        metrics.REQUESTS_WAITING.set(waiting)
        metrics.REQUESTS_RUNNING.set(running)

    def scheduled(self, r: RouterRequest) -> None:
        """The request joined the batch (again, after a preemption: counted once)."""
        if r.scheduled_at is None:
            r.scheduled_at = time.perf_counter()
            metrics.QUEUE_TIME.observe(r.scheduled_at - r.arrival)

    def failed(self, code: str) -> None:
        """A request ended with an error (``streaming.RequestError``'s code)."""
        metrics.REQUEST_ERRORS.labels(code.upper()).inc()

    # ---- drafters -------------------------------------------------------------------------------
    def drafter_answered(self, name: str) -> None:
        metrics.DRAFTER_UP.labels(name).set(1)

    def drafter_failed(self, name: str) -> None:
        metrics.DRAFTER_FAILURES.labels(name).inc()
        metrics.DRAFTER_UP.labels(name).set(0)

    # ---- one request's step -----------------------------------------------------------------------
    def verified(self, r: RouterRequest, choice: StepChoice, drafted: int, accepted: int,
                 draft_s: float, verify_s: float, predicted_s: float = 0.0,
                 batch_size: int = 1) -> StepInfo:
        """Count one verified step of ``r`` (``drafted`` tree nodes, ``accepted`` of them; no
        drafter = no speculation) and return its ``StepInfo``."""
        r.steps += 1
        name = choice.drafter or ""
        k = choice.k if choice.drafter else 0
        metrics.SPEC_STEPS.labels(name).inc()
        metrics.SPEC_K.labels(name).observe(k)
        if choice.drafter:
            tally = r.tallies.setdefault(name, DrafterTally())
            tally.steps += 1
            tally.draft_tokens += drafted
            tally.accepted_tokens += accepted
            metrics.SPEC_DRAFTS.labels(name).inc()
            metrics.SPEC_DRAFT_TOKENS.labels(name).inc(drafted)
            metrics.SPEC_ACCEPTED.labels(name).inc(accepted)
            for pos in range(1, accepted + 1):
                metrics.SPEC_ACCEPTED_POS.labels(name, str(pos)).inc()
            if self.store is not None:
                self.store.record(population_name(name, r.sampling.greedy), drafted, accepted,
                                  draft_s, verify_s)
        else:
            r.steps_off += 1
        return StepInfo(name, k, drafted, accepted, draft_s + verify_s, predicted_s, batch_size)

    def streamed(self, r: RouterRequest, tokens: int, finish: str | None) -> None:
        """``tokens`` new tokens went to the client (``finish``: the last message's reason)."""
        now = time.perf_counter()
        metrics.GENERATION_TOKENS.inc(tokens)
        if r.first_token_at is None:
            r.first_token_at = now
            metrics.TTFT.observe(now - r.arrival)
        else:
            metrics.ITL.observe(now - (r.last_token_at or now))
        r.last_token_at = now
        if finish is None:
            return
        metrics.E2E.observe(now - r.arrival)
        if len(r.generated) > 1:
            metrics.TPOT.observe((now - r.first_token_at) / (len(r.generated) - 1))
        metrics.REQUEST_SUCCESS.labels(finish).inc()

    # ---- one batch step ---------------------------------------------------------------------------
    def step(self, batch_size: int, draft_s: float, verify_s: float, step_s: float,
             drafting_s: Mapping[str, float], service_verify_s: float,
             prediction: StepPrediction | None) -> None:
        """A micro-batch step: waiting for drafts ``draft_s``, for the verifier ``verify_s``, in
        all ``step_s``; the drafters' own seconds per call and the verifier's (what is left is
        round trips and the router's own work); the policy's prediction of it."""
        metrics.STEP_SECONDS.observe(step_s)
        metrics.STEP_DRAFT_SECONDS.observe(draft_s)
        metrics.STEP_VERIFY_SECONDS.observe(verify_s)
        drafting = max(drafting_s.values(), default=0.0)  # the drafters run concurrently
        metrics.RPC_OVERHEAD_SECONDS.observe(max(0.0, step_s - drafting - service_verify_s))
        metrics.BATCH_SIZE.observe(batch_size)
        if prediction is not None and prediction.step_s > 0:  # round trips included
            metrics.STEP_PREDICTED_SECONDS.observe(prediction.step_s)
            metrics.STEP_PREDICTION_ERROR.observe(
                abs(prediction.step_s - step_s) / max(step_s, 1e-9))

