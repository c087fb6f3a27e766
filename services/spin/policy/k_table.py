"""Synergy's batch-size → k table from a cost model: what ``spin profile`` prints for the model
it fits (the controller itself chooses k per request and step; without a cost model it falls
back to ``goodput.DEFAULT_TABLE``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from ..timing.cost_model import CostModel
from .goodput import expected_tokens


def k_table(model: CostModel, acceptance: dict[str, float], batch_sizes: Iterable[int],
            k_max: int, context: int, *, margin: float = 0.0,
            pipelined: bool = False) -> dict[int, int]:
    """Synergy's batch-size → k table from a cost model.

    For each batch size B: a uniform batch of B requests, each with ``context`` tokens of context
    and the *mean* of ``acceptance`` (over the drafters named there), drafting with cost = the mean
    predicted draft time over those drafters that have a cost. k maximises::

        B·E(a, k) / (t_draft(B, k) + t_verify(B, B·(k+1), B·context))   (max(·,·) if pipelined)

    with E(a, k) = (1 − a^(k+1)) / (1 − a); k = 0 unless it beats k = 0 by ``margin``; ties go to
    the smaller k.
    """
    names = [n for n in acceptance if model.has_drafter(n)]
    a = float(np.mean(list(acceptance.values()))) if acceptance else 0.0
    out: dict[int, int] = {}
    for b in sorted(set(int(x) for x in batch_sizes)):
        if b <= 0:
            continue

        def goodput(k: int) -> float:
            draft = (float(np.mean([model.predict_draft(n, b, k, b * context) for n in names]))
                     if names and k > 0 else 0.0)
            verify = model.predict_verify(b, b * (k + 1), b * context)
            step = max(draft, verify) if pipelined else draft + verify
            return b * expected_tokens(a, k) / step if step > 0 else math.inf

        base = goodput(0)
        best_k, best = 0, base
        for k in range(1, (k_max if names else 0) + 1):
            g = goodput(k)
            if g > best:
                best_k, best = k, g
        out[b] = best_k if best >= (1 + margin) * base else 0
    return out
