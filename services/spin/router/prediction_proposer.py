"""Predicted Outputs as a proposer of the router's pool (``proposers.py`` has the interface and
the other kinds): model-free drafts from the request's own prediction (OpenAI's ``prediction``,
``RequestParams.prediction``), aligned as the output moves past edits
(``engine/prediction.py``). It drafts only for requests that carry a prediction; for the others
it finds no match, so the policy never picks it for them."""

from __future__ import annotations

from ..engine.prediction import PREDICTION, PredictionAligner
from ..engine.tree import TokenTree
from ..policy.base import StepChoice
from ..policy.outcome import Score
from .proposers import Group, ModelFree, Proposals
from .requests import RequestParams, RouterRequest


class PredictedOutputs(ModelFree):
    """Model-free drafts from each request's prediction, in the router: a chain of the
    prediction's next tokens where the output stands in it (no tree: one continuation)."""

    name = PREDICTION

    def __init__(self) -> None:
        self._aligners: dict[str, tuple[RequestParams, PredictionAligner]] = {}
        """Request id -> the request it was made for (a reused id starts afresh), its
        aligner."""
        self._scored: dict[str, int] = {}
        """Request id -> context tokens it was scored on (each round scores what came since)."""

    def aligner(self, r: RouterRequest) -> PredictionAligner | None:
        """``r``'s aligner with its output taken in; None without a prediction."""
        if not r.params.prediction:
            return None
        kept = self._aligners.get(r.request_id)
        if kept is None or kept[0] is not r.params:
            kept = self._aligners[r.request_id] = (r.params,
                                                   PredictionAligner(r.params.prediction))
        kept[1].extend(r.generated)
        return kept[1]

    def matches(self, r: RouterRequest) -> int:
        a = self.aligner(r)
        return 1 if a is not None and a.has_draft() else 0

    def draft(self, r: RouterRequest, c: StepChoice) -> TokenTree | None:
        a = self.aligner(r)
        tokens = a.propose(c.k) if a is not None else []
        return TokenTree.chain(tokens) if tokens else None

    async def score(self, group: Group, timeout_s: float) -> Proposals:
        out = Proposals()
        for r, _ in group:  # like prompt lookup: only the output tokens since the last round
            start = max(len(r.prompt), self._scored.get(r.request_id, 0))
            self._scored[r.request_id] = r.context_len
            a = self.aligner(r)
            matches, positions = a.score(start - len(r.prompt)) if a is not None else (0, 0)
            out.scores[r.request_id] = Score(self.name, matches, positions)
        return out

    def release(self, request_id: str) -> None:
        self._aligners.pop(request_id, None)
        self._scored.pop(request_id, None)
