"""A trace of every verified step, one JSON object a line (``spin router --step-trace FILE``).

What a step did and what the policy expected of it, for a user asking why speculation gains or
loses on their traffic: per request its drafter, k, draft tokens, accepted and emitted tokens
and decoding; for the step its measured times (each drafter's call, the verifier's forward, the
router's waits, the whole step) beside the cost model's prediction of each. The router's metrics
aggregate the same numbers; the trace keeps each step, so a step's prediction can be set against
its measurement by batch size and k (``spin bench grid --trace DIR`` writes one per run).

A line, e.g.::

    {"t": 12.031, "batch": 32, "step_s": 0.2114, "verify_s": 0.1302, "verify_wait_s": 0.1391,
     "draft_wait_s": 0.0652, "draft_s": {"draft-code": 0.0611},
     "predicted": {"step_s": 0.1702, "verify_s": 0.1021, "draft_s": {"draft-code": 0.0533},
                   "scoring_s": 0.0, "plain_s": 0.1124, "tokens": 52.3, "scoring_calls": 0,
                   "scoring_tokens": 0},
     "requests": [["r1", "draft-code", 2, 2, 1, 2, true, false], ...]}

``requests`` rows are [request id, drafter or null, k, drafted, accepted, emitted, greedy,
prefilled: the step was the request's first, which prefilled its prompt];
``predicted`` is null when the policy predicted nothing; its ``plain_s`` is the predicted time
of the batch with no speculation and ``tokens`` the tokens it expected, so the gain it predicted
is ``tokens / step_s`` over ``batch / plain_s``; ``scoring_calls`` and ``scoring_tokens`` count
the drafters' scoring calls that ran beside the verification and the tokens they fed. ``t`` is seconds since the trace began.
Writes are line-buffered; a write that fails (disk full) is logged once and the trace stops,
never the router.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Collection
from pathlib import Path
from typing import TextIO

from ..policy.outcome import StepOutcome

log = logging.getLogger(__name__)


def _r(x: float) -> float | None:
    """Seconds and token counts to 6 decimals; None for NaN (JSON has no NaN)."""
    return round(float(x), 6) if math.isfinite(x) else None


def step_record(step: StepOutcome, t: float, prefilled: Collection[str] = ()) -> dict:
    """The trace's JSON object for ``step`` (``t``: seconds since the trace began;
    ``prefilled``: the requests whose first step it was)."""
    p = step.prediction
    return {
        "t": _r(t), "batch": step.batch_size, "step_s": _r(step.step_s),
        "verify_s": _r(step.verify_s), "verify_wait_s": _r(step.verify_wait_s),
        "draft_wait_s": _r(step.draft_wait_s),
        "draft_s": {n: _r(s) for n, s in step.draft_s.items()},
        "predicted": None if p is None else {
            "step_s": _r(p.step_s), "verify_s": _r(p.verify_s),
            "draft_s": {n: _r(s) for n, s in p.draft_s.items()}, "scoring_s": _r(p.scoring_s),
            "plain_s": _r(p.plain_s), "tokens": _r(p.tokens),
            "scoring_calls": p.scoring_work[0], "scoring_tokens": p.scoring_work[1]},
        "requests": [[o.request_id, o.choice.drafter, o.choice.k, o.drafted, o.accepted,
                      o.emitted, o.greedy, o.request_id in prefilled] for o in step.requests],
    }


class StepTrace:
    """Appends ``step_record`` lines to a file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = self.path.open("a", buffering=1, encoding="utf-8")
        self._start = time.monotonic()
        log.info("tracing every step to %s", self.path)

    def write(self, step: StepOutcome, prefilled: Collection[str] = ()) -> None:
        if self._file is None:
            return
        try:
            self._file.write(json.dumps(step_record(step, time.monotonic() - self._start,
                                                    prefilled), separators=(",", ":")) + "\n")
        except OSError as e:
            log.error("step trace %s stopped: %s", self.path, e)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None


def read_trace(path: str | Path) -> list[dict]:
    """The records of a trace file (a torn last line, from a router that died mid-write, is
    left out)."""
    out = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out
