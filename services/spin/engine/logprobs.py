"""The target's log-probabilities of the tokens a verification step emitted (OpenAI's
``logprobs``): from the rows the step already computed, so asking for them changes no token.

Rows are those of ``rejection.py``: row 0 is the last context token's (it predicts the first
emitted token), row ``1 + n`` node ``n``'s. The emitted tokens are the accepted path's nodes and
then the correction or bonus token, so emitted token ``j`` comes from row 0 for ``j = 0`` and
from row ``1 + accepted[j - 1]`` after it. The distribution is the model's own (a log-softmax
of the raw logits, before temperature and top-p), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

MAX_LOGPROBS = 20
"""Alternatives per token at most (OpenAI's ``top_logprobs`` limit)."""


@dataclass(frozen=True)
class TokenLogprobs:
    """One emitted token's log-probability and the most likely alternatives at its position."""

    logprob: float
    """log p(token) under the target."""
    top: tuple[tuple[int, float], ...] = ()
    """The most likely tokens and their log-probabilities, most likely first."""


class EmittedPath(Protocol):
    """What a step emitted, as ``rejection.Verdict`` holds it (this module sits below it)."""

    @property
    def accepted(self) -> Sequence[int]:
        """Accepted node indices, from the root down."""

    @property
    def tokens(self) -> Sequence[int]:
        """Emitted tokens: the accepted nodes' tokens, then the correction or bonus token."""


def emitted_logprobs(logits: torch.Tensor, verdict: EmittedPath, top: int) -> list[TokenLogprobs]:
    """``logits``: one request's rows [N + 1, V] (or more rows: padding is never read); ``top``:
    alternatives per token (0: none). One entry per ``verdict.tokens`` (a ``Verdict``)."""
    rows = [0] + [1 + n for n in verdict.accepted]
    picked = logits[rows].float().log_softmax(dim=-1)                           # [T, V]
    tokens = torch.tensor(verdict.tokens, device=picked.device)
    chosen = picked.gather(1, tokens[:, None])[:, 0].tolist()                   # [T]
    if top <= 0:
        return [TokenLogprobs(lp) for lp in chosen]
    values, ids = picked.topk(min(top, picked.shape[-1]), dim=-1)               # [T, top]
    return [TokenLogprobs(lp, tuple(zip(i, v)))
            for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]
