"""SmartSpec's speculation-length controller: per step, the k per request that maximises goodput.

Expected tokens of one step for a request with acceptance rate a drafting a chain of k::

    E(a, k) = (1 − a^(k+1)) / (1 − a)        (k + 1 when a = 1; 1 when k = 0)

so one more draft token adds a^(k+1). Goodput of an assignment k_1..k_B over a batch::

    G(k) = Σ_i E(a_i, k_i) / T(k)
    T(k) = max_d t_draft(d, sub-batch of d) + t_verify(B, Σ_i (k_i + 1), Σ_i context_i)

with drafters running concurrently (hence the max) and, when ``pipelined`` (SPIN's pipeline, which
overlaps drafting of one micro-batch with verification of another), T(k) = max(draft, verify)
instead of the sum. Times come from ``cost_model.CostModel``.

Acceptance a_i is tracked per (request, drafter) by ``AcceptanceTracker`` (``acceptance.py``): a
discounted maximum-likelihood estimate for chains that stop at their first rejection, seeded at
the drafter's population rate.

The controller maximises G(k) (``objective="throughput"``) or, by default, the *fair* objective

    F(k) = B · (Π_i E(a_i, k_i))^(1/B) / T(k)      (= G(k) for one request)

B times the geometric mean of the requests' own tokens per second (proportional fairness). Every
request pays for a longer step; G counts only the sum, so on compute-bound verification (a CPU,
or a GPU at a large batch) it lets the requests that draft well speculate long while one that
drafts badly, at k = 0, gets one token from a step several times as long: past saturation that
request is the latency tail. F weighs each request's slowdown. ``spin bench sweep --fractions
1,2`` (the load sweep of ``spin bench policy`` on the tuning split, a fresh deployment per run),
at twice the batched capacity of speculation off, auto / off: mean latency 0.64 and 0.74 with F
against 0.73 and 0.78 with G, slowest request (p99 of 64) 0.80 and 1.07 against 1.03 and 0.99
(0.97 in a third run of G, ``spin bench sweep``); at capacity, mean 0.61 and 0.52 against 0.65
and 0.60. Six more runs of the same sweep through a script gave p99 0.87-0.95 (F, three runs)
against 1.02-1.08 (G, three runs). The tail stays noisy either way: it is one request of 64.

Search: greedy coordinate ascent. From all k = 0 repeatedly apply the single ±1 change of one
request's k (0..k_max) with the best objective; stop when none improves. Because a drafter call
has a fixed cost (launch, one forward per level), the first +1 alone may not pay while k = 3 does,
so the ascent is also run from the best *uniform* k (SmartSpec's scan of k = 0..k_max, over all
requests and over each drafter's requests alone) and the better end point wins. With one request
to speculate (a request alone: the light-load case) that scan is exhaustive and decides by itself
(the smallest best k): the two ascents cost the router about 1 ms of Python per step there.
Finally the margin rule: unless the best objective beats all-zeros by ``margin``, every request
gets k = 0. Without a cost model the controller uses a batch-size → k table (Synergy).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from ..timing.cost_model import CostModel
from .acceptance import AcceptanceTracker
from .calibration import Calibration
from .choice import StepPrediction
from .learned_config import ControllerConfig

DEFAULT_TABLE: dict[int, int] = {1: 4, 4: 3, 16: 2, 32: 1, 64: 0}
"""Batch size → k when there is no cost model (nearest batch size at or below)."""


def expected_tokens(a: float, k: int) -> float:
    """Expected tokens of one step: (1 − a^(k+1)) / (1 − a); k + 1 when a = 1, 1 when k = 0."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def _expected_tokens_v(a: np.ndarray, k: np.ndarray) -> np.ndarray:
    one = a >= 1.0
    safe = np.where(one, 0.0, a)
    return np.where(one, k + 1.0, (1.0 - safe ** (k + 1)) / (1.0 - safe))


def _step_s(draft: np.ndarray | float, verify: float, pipelined: bool) -> np.ndarray | float:
    """Step seconds from drafting and verification: their sum, or their max when pipelined."""
    return np.maximum(draft, verify) if pipelined else draft + verify


def _others_max(x: np.ndarray) -> np.ndarray:
    """[D] -> [D]: the largest of the other entries (0 when none, or when all are below)."""
    out = np.full(len(x), float(x.max(initial=0.0)))
    if len(x) > 1:
        second, first = np.argsort(x, kind="stable")[-2:]
        out[first] = max(float(x[second]), 0.0)
    elif len(x) == 1:
        out[0] = 0.0
    return out


class _Batch:
    """Arrays of one choose() call plus the aggregate step-time model (vectorised)."""

    def __init__(self, cost: CostModel, batch: list[tuple[str, str | None, int]],
                 acc: np.ndarray, pipelined: bool, extra: int = 0, fair: bool = False,
                 cal: Calibration | None = None) -> None:
        self.cost, self.pipelined, self.extra, self.fair = cost, pipelined, extra, fair
        self.cal = cal or Calibration(rate=0.0)
        self.names = sorted({d for _, d, _ in batch if d is not None and cost.has_drafter(d)})
        pos = {d: i for i, d in enumerate(self.names)}
        self.idx = np.array([pos.get(d, -1) if d is not None else -1 for _, d, _ in batch],
                            dtype=int)
        self.eligible = self.idx >= 0
        self.ctx = np.array([c for _, _, c in batch], dtype=float)
        self.a = acc
        self.terms = np.array([np.asarray(cost.draft_terms(d)) * self.cal.draft(d)
                               for d in self.names]).reshape(-1, 6)
        self.b, self.c_total = len(batch), float(self.ctx.sum())
        self.plain = float(cost.predict_verify(self.b, self.b + extra, int(self.c_total)))
        """The model's verification of the batch with every k = 0 (prefills included)."""

    def verify(self, scored: float | np.ndarray) -> float | np.ndarray:
        """Calibrated seconds of the verification scoring ``scored`` tokens (besides
        ``extra``), per element of an array too."""
        full = self.cost.predict_verify(self.b, np.asarray(scored, dtype=float) + self.extra,
                                        int(self.c_total))
        out = self.cal.verify(self.plain, full)
        return float(out) if np.ndim(out) == 0 else out

    def aggregates(self, k: np.ndarray) -> tuple[np.ndarray, ...]:
        """Per drafter: max k, count at max, #active, Σk, Σk·ctx."""
        nd = len(self.names)
        e = self.eligible
        d, kd, cd = self.idx[e], k[e], self.ctx[e]
        kmax = np.zeros(nd)
        np.maximum.at(kmax, d, kd)
        cnt = np.bincount(d, weights=(kd == kmax[d]), minlength=nd)
        act = np.bincount(d, weights=(kd > 0), minlength=nd)
        sk = np.bincount(d, weights=kd, minlength=nd)
        skc = np.bincount(d, weights=kd * cd, minlength=nd)
        return kmax, cnt, act, sk, skc

    def draft_time(self, d: np.ndarray | int, kmax, act, sk, skc) -> np.ndarray:
        t = self.terms[d]
        return ((act > 0) * t[..., 0] + kmax * t[..., 1] + sk * t[..., 2] + skc * t[..., 3]
                + act * t[..., 4] + kmax * np.log2(np.maximum(act, 1)) * t[..., 5])

    def combine(self, draft: np.ndarray | float, verify: float) -> np.ndarray | float:
        return np.maximum(_step_s(draft, verify, self.pipelined), 1e-12)

    def step_s(self, k: np.ndarray) -> float:
        kmax, _, act, sk, skc = self.aggregates(k)
        drafts = self.draft_time(np.arange(len(self.names)), kmax, act, sk, skc)
        return float(self.combine(drafts.max(initial=0.0), self.verify((k + 1).sum())))

    def goodput(self, k: np.ndarray) -> float:
        return float(_expected_tokens_v(self.a, k).sum()) / self.step_s(k)

    def _tokens(self, e: np.ndarray) -> np.ndarray | float:
        """The objective's tokens per step from expected tokens ``e`` [..., B]: their sum, or
        (fair) B times their geometric mean."""
        if self.fair:
            return self.b * np.exp(np.log(e).mean(axis=-1))
        return e.sum(axis=-1)

    def score(self, k: np.ndarray) -> float:
        """The objective of ``k``: ``goodput``, or (fair) B times the geometric mean of the
        requests' tokens per second."""
        return float(self._tokens(_expected_tokens_v(self.a, k))) / self.step_s(k)

    def uniform_scores(self, k_max: int, group: np.ndarray | None = None) -> np.ndarray:
        """[k_max]: ``score(j * group)`` for j = 1..k_max, in one vectorised pass (a step's
        choice scans them all; one call each cost about 40 us of numpy overhead). ``group``:
        [B] bool, the eligible requests set to j (default all), the others at 0."""
        j = np.arange(1, k_max + 1, dtype=float)[:, None]                         # [J, 1]
        e = self.eligible if group is None else self.eligible & group             # [B]
        nd = len(self.names)
        act = np.bincount(self.idx[e], minlength=nd).astype(float)               # [D]
        ctx = np.bincount(self.idx[e], weights=self.ctx[e], minlength=nd)        # [D]
        # every request of the group at k = j: per drafter max k = j, Σk = j·A, Σk·ctx = j·Σctx
        drafts = self.draft_time(np.arange(nd), j * (act > 0), act, j * act, j * ctx)  # [J, D]
        drafts = drafts.max(axis=1, initial=0.0)                                  # [J]
        scored = self.b + j[:, 0] * float(e.sum())                               # [J]
        verify = self.verify(scored)                                              # [J]
        k = j * e[None, :]                                                        # [J, B]
        tokens = self._tokens(_expected_tokens_v(self.a[None, :], k))             # [J]
        return tokens / self.combine(drafts, verify)

    def uniform_start(self, k_max: int) -> tuple[np.ndarray, list[float]]:
        """The best uniform start for the ascent ([B]) and the scan over all eligible requests
        (``uniform_scores``). With several drafters each one's requests are also scanned alone
        (a drafter's call has a fixed cost its requests share, which single ±1 steps of the
        ascent cannot climb over; the fair objective often wants only some drafters on)."""
        by_j = self.uniform_scores(k_max)
        groups = [self.eligible] + ([self.idx == d for d in range(len(self.names))]
                                    if len(self.names) > 1 else [])
        best_g, best_k = -1.0, np.zeros(self.b)
        for i, g in enumerate(groups):
            scan = by_j if i == 0 else self.uniform_scores(k_max, g)
            j = int(np.argmax(scan))
            if scan[j] > best_g:
                best_g, best_k = float(scan[j]), (j + 1) * (self.eligible & g).astype(float)
        return best_k, by_j.tolist()

    def ascend(self, k: np.ndarray, k_max: int) -> tuple[np.ndarray, float]:
        """Greedy ±1 coordinate ascent from ``k``; returns the end point and its ``score``."""
        k = k.copy()
        g = self.score(k)
        all_d = np.arange(len(self.names))
        for _ in range(4 * (k_max + 1) * max(self.b, 1)):  # strictly increasing: a safety cap
            kmax, cnt, act, sk, skc = self.aggregates(k)
            drafts = self.draft_time(all_d, kmax, act, sk, skc)
            others = _others_max(drafts)                                           # [D]
            e = _expected_tokens_v(self.a, k)                                     # [B]
            tokens, log_e = float(e.sum()), float(np.log(e).sum())
            scored = float((k + 1).sum())
            best_g, best_i, best_step = g, -1, 0
            threshold = g * (1 + 1e-12)
            for step, ok in ((+1, self.eligible & (k < k_max)), (-1, self.eligible & (k > 0))):
                i = np.flatnonzero(ok)
                if i.size == 0:
                    continue
                d, ki, ci = self.idx[i], k[i], self.ctx[i]
                if step > 0:
                    new_max = np.maximum(kmax[d], ki + 1)
                    new_act = act[d] + (ki == 0)
                    gain = self.a[i] ** (ki + 1)
                else:
                    new_max = kmax[d] - ((ki == kmax[d]) & (cnt[d] == 1))
                    new_act = act[d] - (ki == 1)
                    gain = -(self.a[i] ** ki)
                new_draft = self.draft_time(d, new_max, new_act, sk[d] + step,
                                            skc[d] + step * ci)
                t = self.combine(np.maximum(new_draft, others[d]), self.verify(scored + step))
                if self.fair:
                    new = self.b * np.exp((log_e - np.log(e[i]) + np.log(e[i] + gain)) / self.b)
                else:
                    new = tokens + gain
                cand = new / t
                j = int(np.argmax(cand))
                if cand[j] > max(best_g, threshold):
                    best_g, best_i, best_step = float(cand[j]), int(i[j]), step
            if best_i < 0:
                break
            k[best_i] += best_step
            g = best_g
        return k, g


class SpecLengthController:
    """Chooses k per request and step (SmartSpec) from acceptance estimates and a cost model."""

    def __init__(self, cost: CostModel | None = None, cfg: ControllerConfig | None = None,
                 table: dict[int, int] | None = None) -> None:
        self.cost = cost
        """Step-time model; None = use ``table``."""
        self.cfg = cfg or ControllerConfig()
        self.table = dict(sorted((table or DEFAULT_TABLE).items()))
        """Batch size → k fallback (nearest batch size at or below; the smallest below all)."""
        self.tracker = AcceptanceTracker(self.cfg)
        self.calibration = Calibration(self.cfg.calibration)
        """Corrections of the cost model learnt on served steps (``calibration.py``)."""

    # ---- learning ------------------------------------------------------------------------------

    def observe(self, request_id: str, drafter: str, k: int, accepted: int) -> None:
        self.tracker.update(request_id, drafter, k, accepted)

    def release(self, request_id: str) -> None:
        self.tracker.release(request_id)

    # ---- choice --------------------------------------------------------------------------------

    def table_k(self, batch_size: int) -> int:
        keys = [b for b in self.table if b <= batch_size] or [min(self.table, default=0)]
        return min(self.table.get(max(keys), 0), self.cfg.k_max)

    def _batch(self, batch: list[tuple[str, str | None, int]], extra: int = 0) -> _Batch:
        assert self.cost is not None
        acc = np.array([self.tracker.get(r, d) if d is not None else 0.0 for r, d, _ in batch],
                       dtype=float)
        return _Batch(self.cost, batch, acc, self.cfg.pipelined, extra,
                      self.cfg.objective == "fair", self.calibration)

    def choose(self, batch: list[tuple[str, str | None, int]], extra: int = 0) -> list[int]:
        """k in 0..k_max per (request_id, drafter or None, context_len); None → 0. A drafter the
        cost model has no cost for also gets 0 (we do not speculate blind). ``extra``: tokens the
        verification scores besides each request's k + 1 (the prompts of requests it prefills),
        which make the step longer whatever k is."""
        if not batch:
            return []
        if self.cost is None:
            k = self.table_k(len(batch))
            return [k if d is not None else 0 for _, d, _ in batch]
        bt = self._batch(batch, extra)
        zero = np.zeros(len(batch))
        g0 = bt.score(zero)
        if not bt.eligible.any() or self.cfg.k_max == 0:
            return [0] * len(batch)
        start, by_j = bt.uniform_start(self.cfg.k_max)
        if bt.eligible.sum() == 1:  # one request's k: the scan above is exhaustive
            top = max(by_j)
            j = next(j for j, g in enumerate(by_j, 1) if g >= top * (1 - 1e-12))  # smallest
            best_k, best_g = j * bt.eligible.astype(float), by_j[j - 1]
        else:
            best_k, best_g = bt.ascend(zero, self.cfg.k_max)
            k_u, g_u = bt.ascend(start, self.cfg.k_max)
            if g_u > best_g:
                best_k, best_g = k_u, g_u
        if best_g < (1 + self.cfg.margin) * g0:
            return [0] * len(batch)
        return [int(x) for x in best_k]

    def predicted_goodput(self, batch: list[tuple[str, str | None, int]],
                          ks: list[int]) -> float:
        """Predicted tokens per second of ``ks``; NaN without a cost model."""
        if self.cost is None:
            return math.nan
        bt = self._batch(batch)
        return bt.goodput(np.where(bt.eligible, np.asarray(ks, dtype=float), 0.0))

    def predicted_parts(self, batch: list[tuple[str, str | None, int]], ks: list[float],
                        extra: int = 0, scored: list[float] | None = None,
                        ) -> tuple[dict[str, float], float]:
        """Predicted seconds of each drafter's call (those with a drafting request) and of the
        verification, for a step running ``ks``; ({}, NaN) without a cost model. Requests with no
        drafter, or one with no cost, add their k + 1 scored tokens but no draft time; ``extra``
        as in ``choose``; ``scored``: each request's tokens verified, when not k + 1 (a tree's
        nodes + 1)."""
        if len(ks) != len(batch):
            raise ValueError(f"{len(ks)} k values for {len(batch)} requests")
        if self.cost is None:
            return {}, math.nan
        if not any(ks) and (scored is None or sum(scored) == len(batch)):  # a plain step: no
            b = len(batch)  # arrays (a step the loss guard holds plain predicts this alone)
            plain = float(self.cost.predict_verify(b, b + extra, sum(c for *_, c in batch)))
            return {}, float(self.calibration.verify(plain, plain))
        bt = self._batch(batch, extra)
        k = np.asarray(ks, dtype=float)
        kmax, _, act, sk, skc = bt.aggregates(np.where(bt.eligible, k, 0.0))
        drafts = bt.draft_time(np.arange(len(bt.names)), kmax, act, sk, skc)
        return ({n: float(t) for n, t, a in zip(bt.names, drafts, act) if a > 0},
                bt.verify(sum(scored) if scored is not None else (k + 1).sum()))

    def predicted_saving(self, batch: list[tuple[str, str | None, int]], ks: list[int],
                         extra: int = 0) -> float | None:
        """Seconds of step per emitted token that ``ks`` saves over k = 0 by the calibrated
        cost model and acceptance estimates (< 0: a loss); None without a model or a draft."""
        if self.cost is None or not any(ks):
            return None
        drafts, verify = self.predicted_parts(batch, ks, extra)
        plain = self.predicted_parts(batch, [0] * len(batch), extra)[1]
        return plain / len(batch) - self.step_s(drafts, verify) / self.expected(batch, ks)

    def expected(self, batch: list[tuple[str, str | None, int]], ks: list[float]) -> float:
        """Expected tokens of a step running ``ks`` (Σ E(a, k) at the acceptance estimates;
        requests without a drafter emit one)."""
        return sum(expected_tokens(self.tracker.get(r, d), k) if d is not None and k > 0 else 1.0
                   for (r, d, _), k in zip(batch, ks))

    def solo_step_s(self, request_id: str, drafter: str, context_len: int) -> np.ndarray:
        """Predicted seconds of a step of this request alone at k = 1..k_max, shape [k_max]
        (``predicted_step_s`` for each k at once); NaN without a cost model."""
        ks = np.arange(1, self.cfg.k_max + 1, dtype=float)                       # [k_max]
        if self.cost is None:
            return np.full(len(ks), math.nan)
        bt = self._batch([(request_id, drafter, context_len)])
        one = np.ones_like(ks)
        draft = (bt.draft_time(0, ks, one, ks, ks * context_len) if bt.eligible[0]
                 else np.zeros_like(ks))
        verify = np.array([bt.verify(k + 1) for k in ks])
        return _step_s(draft, verify, self.cfg.pipelined)

    def solo_goodput(self, request_id: str, drafter: str, rate: float,
                     context_len: int) -> float | None:
        """Tokens per second of the request alone with ``drafter`` at acceptance ``rate`` and
        the best k (``solo_step_s``); None without a cost model."""
        steps = self.solo_step_s(request_id, drafter, context_len)               # [k_max]
        if not (steps > 0.0).all():
            return None
        return max((expected_tokens(rate, k) / t for k, t in enumerate(steps.tolist(), 1)),
                   default=0.0)

    def step_s(self, draft_s: dict[str, float], verify_s: float) -> float:
        """Step seconds from its parts (the drafters' calls run concurrently)."""
        return float(_step_s(max(draft_s.values(), default=0.0), verify_s, self.cfg.pipelined))

    def predicted_step_s(self, batch: list[tuple[str, str | None, int]], ks: list[int]) -> float:
        """Predicted seconds of one step running ``ks`` (NaN without a cost model)."""
        drafts, verify = self.predicted_parts(batch, ks)
        return self.step_s(drafts, verify)

    def calibrate(self, predicted: StepPrediction, draft_s: Mapping[str, float],
                  verify_s: float, verification: bool = True) -> None:
        """A served step's measured seconds (each drafter's call, the verification with its
        round trip) against ``predicted`` (``calibration.py``); ``verification`` False: the
        step's verification does not calibrate (a prefill or scoring calls ran in it)."""
        if self.cost is None or not math.isfinite(predicted.plain_s):
            return
        self.calibration.observe(predicted.plain_s, predicted.verify_s, verify_s,
                                 predicted.draft_s, draft_s, verification)

    def set_cost(self, cost: CostModel | None) -> None:
        """Plan with ``cost`` from now on; the calibration starts again from it."""
        self.cost = cost
        self.calibration.reset()
