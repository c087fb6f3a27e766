"""What the router counts: Prometheus metrics, the acceptance statistics store, and each step's
account for the client (``StepInfo``).

The scheduler reports what happened (a request queued, scheduled, streamed, failed; each
verified step's ``policy.outcome.StepOutcome``, read once per request and once for the step) and
this module turns it into ``obs/metrics.py``'s metrics, ``StatsStore.record`` calls (per drafter,
off the decoding path: the store never blocks) and the per-request tallies (``RequestTally``)
the final message reports.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from ..obs import metrics
from ..policy.loss_guard import StepKind
from ..policy.outcome import RequestOutcome, StepOutcome
from ..policy.population import population_name
from ..stats.store import StatsStore
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

    draft_wait_s: float = 0.0
    """Of ``step_seconds``, the wait for the drafts."""
    forwards: int = 1
    """Target forwards that produced the tokens: one per token for plain steps run several to a
    verifier call (``VerifyTask.steps``), else 1."""

    @classmethod
    def of(cls, r: RequestOutcome, step: StepOutcome, batch_size: int) -> StepInfo:
        """A request's part of a step (``step``: its times and prediction), as its stream
        message reports it."""
        c = r.choice
        return cls(c.drafter or "", c.k if c.drafter else 0, r.drafted, r.accepted,
                   step.draft_wait_s + step.verify_wait_s,
                   step.prediction.step_s if step.prediction is not None else 0.0,
                   batch_size, step.draft_wait_s)


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
        t = r.tally
        if t.scheduled_at is None:
            t.scheduled_at = time.perf_counter()
            metrics.QUEUE_TIME.observe(t.scheduled_at - t.arrival)

    def failed(self, code: str) -> None:
        """A request ended with an error (``streaming.RequestError``'s code)."""
        metrics.REQUEST_ERRORS.labels(code.upper()).inc()

    # ---- one verified step ----------------------------------------------------------------------
    def verified(self, r: RouterRequest, o: RequestOutcome, info: StepInfo) -> None:
        """Count ``r``'s part ``o`` of a verified step (no drafter = no speculation): its tally,
        the per-drafter metrics, and its population's statistics; each of its target forwards
        (``info.forwards``) counts as a step."""
        t, forwards = r.tally, info.forwards
        t.steps += forwards
        name = o.choice.drafter or ""
        metrics.SPEC_STEPS.labels(name).inc(forwards)
        for _ in range(forwards):
            metrics.SPEC_K.labels(name).observe(o.choice.k if o.choice.drafter else 0)
        if not o.choice.drafter:
            t.steps_off += forwards
            return
        tally = t.drafters.setdefault(name, DrafterTally())
        tally.steps += 1
        tally.draft_tokens += o.drafted
        tally.accepted_tokens += o.accepted
        metrics.SPEC_DRAFTS.labels(name).inc()
        metrics.SPEC_DRAFT_TOKENS.labels(name).inc(o.drafted)
        metrics.SPEC_ACCEPTED.labels(name).inc(o.accepted)
        for pos in range(1, o.accepted + 1):
            metrics.SPEC_ACCEPTED_POS.labels(name, str(pos)).inc()
        if self.store is not None:
            self.store.record(population_name(name, o.greedy), o.drafted, o.accepted,
                              info.draft_wait_s, info.step_seconds - info.draft_wait_s,
                              rejected=o.accepted < o.choice.k)  # a tree's k: its depth

    def streamed(self, r: RouterRequest, tokens: int, finish: str | None) -> None:
        """``tokens`` new tokens went to the client (``finish``: the last message's reason)."""
        now, t = time.perf_counter(), r.tally
        metrics.GENERATION_TOKENS.inc(tokens)
        if t.first_token_at is None:
            t.first_token_at = now
            metrics.TTFT.observe(now - t.arrival)
        else:
            metrics.ITL.observe(now - (t.last_token_at or now))
        t.last_token_at = now
        if finish is None:
            return
        metrics.E2E.observe(now - t.arrival)
        if len(r.generated) > 1:
            metrics.TPOT.observe((now - t.first_token_at) / (len(r.generated) - 1))
        metrics.REQUEST_SUCCESS.labels(finish).inc()

    # ---- one batch step -------------------------------------------------------------------------
    def step(self, step: StepOutcome, measured: Mapping[StepKind, tuple[float, float, bool]],
             calibration: Mapping[tuple[str, str], float]) -> None:
        """A micro-batch step's times (what is left of the step past the drafters' and the
        verifier's own seconds is round trips and the router's own work), the drafters that
        answered or failed, the policy's prediction of the step, what the policy measured of
        speculation per kind of step (``Policy.measured``) and its cost model's corrections
        (``Policy.calibration``)."""
        for (part, drafter), factor in calibration.items():
            metrics.COST_CALIBRATION.labels(part, drafter).set(factor)
        for name, ok in step.drafters_called.items():
            metrics.DRAFTER_UP.labels(name).set(1 if ok else 0)
            if not ok:
                metrics.DRAFTER_FAILURES.labels(name).inc()
        metrics.STEP_SECONDS.observe(step.step_s)
        metrics.STEP_DRAFT_SECONDS.observe(step.draft_wait_s)
        metrics.STEP_VERIFY_SECONDS.observe(step.verify_wait_s)
        metrics.RPC_OVERHEAD_SECONDS.observe(max(0.0, step.rest_s - step.verify_s))
        metrics.BATCH_SIZE.observe(step.batch_size)
        prediction = step.prediction
        for (bucket, decoding), (on, off, speculating) in measured.items():
            size = f"{1 << (bucket - 1)}-{(1 << bucket) - 1}"  # the sizes of one bit length
            metrics.SPEC_MEASURED_RATE.labels(size, decoding, "on").set(on)
            metrics.SPEC_MEASURED_RATE.labels(size, decoding, "off").set(off)
            metrics.SPEC_GUARD.labels(size, decoding).set(1 if speculating else 0)
        if prediction is not None and prediction.step_s > 0:  # round trips included
            metrics.STEP_PREDICTED_SECONDS.observe(prediction.step_s)
            metrics.STEP_PREDICTION_ERROR.observe(
                abs(prediction.step_s - step.step_s) / max(step.step_s, 1e-9))
