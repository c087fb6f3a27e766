"""A fitted model of step time: one target verification forward plus the drafters' calls.

Verification (one target forward over the whole batch)::

    t_verify = c0 + c1·batch + c2·scored_tokens + c3·context_tokens + c4·scored_tokens·mean_context
               + c5·[scored_tokens > 1]

with ``scored_tokens`` = Σ_i (tree size_i + 1), ``context_tokens`` = Σ_i context_i and
``mean_context`` = context_tokens / batch (so the c4 term ≈ attention of the new tokens over the
contexts: Σ_i scored_i·context_i for a uniform batch). The c5 term is a forward over more than
one row: its matrix products over one token run as matrix-vector products, over several as
matrix-matrix ones, which cost more per forward. Measured in process on this project's 2-core CPU
(demo target, float32, one thread, 300 tokens of context each): one request scoring 1, 2, 3 and 5
tokens took 9.9, 12.4, 16.0 and 15.5 ms; two requests scoring 1 and 2 each, 14.8 and 15.3 ms.
Without the term the fit (on 1, 5 and 9 tokens a request) spread that step over ``c2``, predicting
a single stream's 2 tokens at about 10 ms, and the controller of a single sampled stream with the
demo's EAGLE head chose k = 1-3, where its steps measured the same 25-29 ms for every k from 1 to
4 (a router step trace on tuning prompts) and only a long chain pays.

Drafting (one call of a model drafter that drafts k levels; each level is one forward over the
requests still drafting, as ``engine.drafter`` does)::

    t_draft = d0 + k·(d1 + d2·batch + d3·context_tokens + d4·log2 batch)      (uniform batch)
    t_draft = d0 + K·(d1 + d4·log2 A) + d2·Σ_i k_i + d3·Σ_i k_i·context_i       (ragged)

with K = max_i k_i and A = #{i: k_i > 0}. The ragged form reduces to the uniform one when every
k_i = k. The ``log2 batch`` term is the concave part of a level's cost measured on CPU: a level
over 4 requests costs about 3x one request, over 32 about 8x, which no linear term fits; on one
quick profile of the demo family it took the drafters' fit error from 11-15% to 5-10%. A model
file written before the term existed (four coefficients) loads with d4 = 0.

``prompt-lookup`` runs in the router: its cost is a tiny constant per speculating request (fitted
as a least-squares slope on the batch size, or 1e-5 s by default). Every drafter costs 0 at k = 0.

Fitting is non-negative least squares (Lawson–Hanson, in numpy) on *relative* residuals (rows
weighted by 1/seconds), which matches the MAPE we report and keeps small batches from being drowned
by large ones; columns are scaled before solving for conditioning.

``policy.k_table`` (Synergy) turns a model into a batch-size → k table for a uniform batch with the mean
acceptance; it is the controller's cold start and fallback.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from ..engine.model_free import MODEL_FREE
from ..engine.prompt_lookup import PROMPT_LOOKUP
from ..engine.tree import fed

VERSION = 1
DEFAULT_PROMPT_LOOKUP_S = 1e-5
"""Prompt lookup: seconds per speculating request and step when not fitted."""


@dataclass(frozen=True)
class VerifySample:
    """One measured target (verification) forward."""

    batch: int
    """Requests in the forward."""
    scored_tokens: int
    """New tokens scored: Σ over requests of (tree size + 1)."""
    context_tokens: int
    """Σ over requests of the context length."""
    seconds: float
    """Measured wall time of the forward."""
    tree: bool = False
    """Every request's new tokens were a drafted tree (two branches at the first level), not a
    chain: what a tree's mask and re-fed nodes add (``CostModel.tree_verify_s``)."""


@dataclass(frozen=True)
class DraftSample:
    """One measured drafter call drafting ``k`` levels for ``batch`` requests."""

    drafter: str
    """Drafter name."""
    batch: int
    """Requests in the call."""
    k: int
    """Levels drafted (samples with k = 0 carry no information and are ignored)."""
    context_tokens: int
    """Σ over requests of the context length."""
    seconds: float
    """Measured wall time of the call."""
    tree: bool = False
    """Every request drafted a tree with two branches at the first level, not a chain."""


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin_x ‖a·x − b‖₂ subject to x ≥ 0 (Lawson–Hanson active set)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    max_iter = max_iter or 3 * n + 30
    tol = 10 * np.finfo(float).eps * max(1.0, float(np.abs(a).max(initial=0.0))) * max(m, n)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        candidates = ~passive & (w > tol)
        if not candidates.any():
            break
        passive[int(np.argmax(np.where(candidates, w, -np.inf)))] = True
        for _ in range(n + 1):  # each pass drops ≥ 1 index from the passive set
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / np.maximum(x[neg] - z[neg], 1e-300)))
            x = x + alpha * (z - x)
            passive &= x > 1e-14 * max(1.0, float(np.abs(x).max()))
            x[~passive] = 0.0
            if not passive.any():
                break
    return x


def _fit_relative(features: np.ndarray, seconds: np.ndarray) -> np.ndarray:
    """Non-negative fit of ``features @ coef ≈ seconds`` minimising squared relative error."""
    w = 1.0 / seconds
    a = features * w[:, None]
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef = nnls(a / scale, np.ones_like(seconds)) / scale
    return coef


def _verify_features(batch: np.ndarray, scored: np.ndarray, context: np.ndarray) -> np.ndarray:
    mean_ctx = context / np.maximum(batch, 1)
    return np.stack([np.ones_like(batch), batch, scored, context, scored * mean_ctx,
                     (scored > 1).astype(float)], axis=1)


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise ValueError(what)


@dataclass
class CostModel:
    """Step-time model; see the module docstring for the formulas."""

    verify: tuple[float, ...]
    """(c0, c1, c2, c3, c4, c5) of the verification model, seconds (a 5-tuple means c5 = 0: a
    model file from before the term)."""
    draft: dict[str, tuple[float, float, float, float, float]] = field(default_factory=dict)
    """Per model drafter: (d0, d1, d2, d3, d4) of the draft model, seconds (a 4-tuple means
    d4 = 0)."""
    prompt_lookup_s: float = DEFAULT_PROMPT_LOOKUP_S
    """Prompt lookup (and every model-free drafter): seconds per speculating request and
    step."""
    verify_samples: int = 0
    """Verification samples the model was fitted on."""
    draft_samples: dict[str, int] = field(default_factory=dict)
    """Draft samples (k > 0) per drafter the model was fitted on."""
    tree_verify_s: float = 0.0
    """What verifying a token tree costs over a chain of as many tokens: seconds per token
    scored (its mask, its out-of-order cache writes), fitted on tree samples (0 without)."""
    tree_draft_s: dict[str, float] = field(default_factory=dict)
    """Per model drafter: seconds per node a tree re-feeds over a chain of as many levels
    (``tree_shape.fed``), fitted on tree samples (0 without)."""

    def __post_init__(self) -> None:
        self.verify = (*self.verify, 0.0) if len(self.verify) == 5 else tuple(self.verify)
        self.draft = {n: (*d, 0.0) if len(d) == 4 else tuple(d)  # type: ignore[misc]
                      for n, d in self.draft.items()}

    # ---- prediction ----------------------------------------------------------------------------

    def has_drafter(self, drafter: str) -> bool:
        """Whether ``drafter``'s cost is known (a model-free drafter's always is)."""
        return drafter in MODEL_FREE or drafter in self.draft

    def predict_verify(self, batch: int, scored_tokens: int | np.ndarray,
                       context_tokens: int) -> float | np.ndarray:
        """Seconds of one target forward (per element of an array of ``scored_tokens``); 0 for
        an empty batch."""
        if batch <= 0:
            return 0.0
        c0, c1, c2, c3, c4, c5 = self.verify
        return (c0 + c1 * batch + c2 * scored_tokens + c3 * context_tokens
                + c4 * scored_tokens * (context_tokens / batch)
                + c5 * (np.asarray(scored_tokens) > 1))

    def predict_padded_verify(self, rows: int, max_q: int, max_k: int) -> float:
        """Seconds of one target forward over ``rows`` requests each padded to ``max_q`` new
        tokens and ``max_k`` context: ``predict_verify(rows, rows * max_q, rows * max_k)``. The
        verifier's request decomposition (``verifier/decompose.py``) prices a group with it."""
        return float(self.predict_verify(rows, rows * max_q, rows * max_k))

    def draft_terms(self, drafter: str) -> tuple[float, float, float, float, float, float]:
        """(d0, d1, d2, d3, d_req, d4) of the ragged model ``[A>0]·d0 + K·d1 + d2·Σk + d3·Σk·ctx
        + d_req·A + d4·K·log2 A`` (A = #(k>0)); raises ``KeyError`` for a drafter with no fitted
        cost."""
        if drafter in MODEL_FREE:  # priced as prompt lookup (suffix decoding: as cheap)
            return (0.0, 0.0, 0.0, 0.0, self.prompt_lookup_s, 0.0)
        if drafter not in self.draft:
            raise KeyError(f"no draft cost for drafter {drafter!r}; known: {sorted(self.draft)}")
        d0, d1, d2, d3, d4 = self.draft[drafter]
        return (d0, d1, d2, d3, 0.0, d4)

    def predict_draft(self, drafter: str, batch: int, k: int, context_tokens: int) -> float:
        """Seconds of one call drafting ``k`` levels for ``batch`` requests (uniform k)."""
        if k <= 0 or batch <= 0:
            return 0.0
        d0, d1, d2, d3, dr, d4 = self.draft_terms(drafter)
        return d0 + k * (d1 + d2 * batch + d3 * context_tokens + d4 * math.log2(batch)) + dr * batch

    def predict_draft_ragged(self, drafter: str, ks: Sequence[int],
                             contexts: Sequence[int]) -> float:
        """Seconds of one call where request i drafts ``ks[i]`` levels (0 = not in the call)."""
        k = np.asarray(ks, dtype=float)
        active = k > 0
        if not active.any():
            return 0.0
        d0, d1, d2, d3, dr, d4 = self.draft_terms(drafter)
        ctx = np.asarray(contexts, dtype=float)
        a = int(active.sum())
        return float(d0 + k.max() * (d1 + d4 * math.log2(a)) + d2 * k.sum()
                     + d3 * (k * ctx).sum() + dr * a)

    # ---- fitting -------------------------------------------------------------------------------

    @classmethod
    def fit(cls, verify_samples: Iterable[VerifySample],
            draft_samples: Iterable[DraftSample] = ()) -> CostModel:
        """Fit on profiled samples. Needs ≥ 1 verification sample; a drafter with no samples
        (k > 0) gets no cost (prompt lookup keeps its default)."""
        every_v = list(verify_samples)
        every_d = list(draft_samples)
        vs = [s for s in every_v if not s.tree]
        _check(len(vs) > 0, "CostModel.fit needs at least one verification sample")
        for s in vs:
            _check(s.batch > 0 and s.seconds > 0 and s.scored_tokens >= s.batch
                   and s.context_tokens >= 0, f"invalid verification sample {s}")
        arr = np.array([[s.batch, s.scored_tokens, s.context_tokens, s.seconds] for s in vs],
                       dtype=float)
        c = _fit_relative(_verify_features(arr[:, 0], arr[:, 1], arr[:, 2]), arr[:, 3])
        by_drafter: dict[str, list[DraftSample]] = {}
        for s in (s for s in every_d if not s.tree):
            _check(s.batch > 0 and s.k >= 0 and s.seconds > 0 and s.context_tokens >= 0,
                   f"invalid draft sample {s}")
            if s.k > 0:
                by_drafter.setdefault(s.drafter, []).append(s)
        draft: dict[str, tuple[float, float, float, float, float]] = {}
        pl = DEFAULT_PROMPT_LOOKUP_S
        for name, ss in sorted(by_drafter.items()):
            d = np.array([[s.batch, s.k, s.context_tokens, s.seconds] for s in ss], dtype=float)
            if name in MODEL_FREE:  # prompt lookup's: least squares through the origin on the
                if name == PROMPT_LOOKUP:  # batch size
                    pl = float((d[:, 0] * d[:, 3]).sum() / (d[:, 0] ** 2).sum())
                continue
            b, k, ctx = d[:, 0], d[:, 1], d[:, 2]
            feats = np.stack([np.ones_like(k), k, k * b, k * ctx, k * np.log2(b)], axis=1)
            draft[name] = tuple(float(x) for x in _fit_relative(feats, d[:, 3]))  # type: ignore
        model = cls(verify=tuple(float(x) for x in c),  # type: ignore[arg-type]
                    draft=draft, prompt_lookup_s=pl, verify_samples=len(vs),
                    draft_samples={n: len(ss) for n, ss in sorted(by_drafter.items())})
        model._fit_trees([s for s in every_v if s.tree], [s for s in every_d if s.tree])
        return model

    def _fit_trees(self, verify: list[VerifySample], draft: list[DraftSample]) -> None:
        """The tree terms: least squares through the origin of what tree samples took beyond
        the chain model's prediction, on the tokens scored (verification) or the nodes re-fed
        (drafting); never below 0."""
        if verify:
            extra = np.array([s.seconds - self.predict_verify(s.batch, s.scored_tokens,
                                                              s.context_tokens) for s in verify])
            x = np.array([s.scored_tokens for s in verify], dtype=float)
            self.tree_verify_s = max(0.0, float((x * extra).sum() / (x * x).sum()))
        for name in sorted({s.drafter for s in draft} & set(self.draft)):
            ss = [s for s in draft if s.drafter == name and s.k > 0]
            extra = np.array([s.seconds - self.predict_draft(name, s.batch, s.k, s.context_tokens)
                              for s in ss])
            x = np.array([s.batch * (fed((2,), s.k) - fed((), s.k)) for s in ss], dtype=float)
            if (x > 0).any():
                self.tree_draft_s[name] = max(0.0, float((x * extra).sum() / (x * x).sum()))

    def mape(self, verify_samples: Iterable[VerifySample],
             draft_samples: Iterable[DraftSample] = ()) -> dict[str, float]:
        """Mean absolute percentage error, as a fraction (0.02 = 2 %), per part: ``"verify"``,
        each drafter with samples (k > 0, known cost) and ``"overall"`` over all of them.
        Parts with no samples are left out; tree samples too (they fit the tree terms)."""
        errs: dict[str, list[float]] = {}
        for s in verify_samples:
            if s.seconds > 0 and not s.tree:
                p = self.predict_verify(s.batch, s.scored_tokens, s.context_tokens)
                errs.setdefault("verify", []).append(abs(p - s.seconds) / s.seconds)
        for s in draft_samples:
            if s.seconds > 0 and s.k > 0 and self.has_drafter(s.drafter) and not s.tree:
                p = self.predict_draft(s.drafter, s.batch, s.k, s.context_tokens)
                errs.setdefault(s.drafter, []).append(abs(p - s.seconds) / s.seconds)
        out = {name: float(np.mean(e)) for name, e in errs.items()}
        every = [x for e in errs.values() for x in e]
        if every:
            out["overall"] = float(np.mean(every))
        return out

    # ---- persistence ---------------------------------------------------------------------------

    def to_json(self) -> dict:
        return {"version": VERSION, "verify": list(self.verify),
                "draft": {n: list(d) for n, d in self.draft.items()},
                "prompt_lookup_s": self.prompt_lookup_s,
                "samples": {"verify": self.verify_samples, "draft": dict(self.draft_samples)},
                "trees": {"verify_s": self.tree_verify_s, "draft_s": dict(self.tree_draft_s)}}

    def save(self, path: str | Path) -> None:
        """Write the model as JSON (``"version": 1``, coefficients, sample counts)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        """Read a model written by ``save``; ``ValueError`` naming the path if it is missing,
        not JSON, of another version or malformed."""
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"cost model file {str(path)!r} does not exist") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"cost model file {str(path)!r} is unreadable or not JSON: {e}") \
                from None
        try:
            _check(isinstance(raw, dict), "not a JSON object")
            _check(raw.get("version") == VERSION,
                   f"version {raw.get('version')!r}, expected {VERSION}")
            verify = tuple(float(x) for x in raw["verify"])
            _check(len(verify) in (5, 6), "'verify' needs 6 coefficients (5 in older files)")
            draft = {str(n): tuple(float(x) for x in d) for n, d in raw.get("draft", {}).items()}
            _check(all(len(d) in (4, 5) for d in draft.values()),
                   "each 'draft' needs 5 coefficients (4 in files without the log term)")
            coefs = [*verify, *(x for d in draft.values() for x in d)]
            pl = float(raw.get("prompt_lookup_s", DEFAULT_PROMPT_LOOKUP_S))
            _check(all(math.isfinite(x) for x in [*coefs, pl]), "non-finite coefficient")
            samples = raw.get("samples", {})
            trees = raw.get("trees", {})
            return cls(verify=verify, draft=draft, prompt_lookup_s=pl,  # type: ignore[arg-type]
                       verify_samples=int(samples.get("verify", 0)),
                       draft_samples={str(n): int(c) for n, c in samples.get("draft", {}).items()},
                       tree_verify_s=float(trees.get("verify_s", 0.0)),
                       tree_draft_s={str(n): float(x)
                                     for n, x in trees.get("draft_s", {}).items()})
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"cost model file {str(path)!r} is malformed: {e}") from None
