"""Predicted Outputs: drafting from a text the client expects the output to repeat, no model.

A request may carry a *prediction* (OpenAI's ``prediction``: a file the model is asked to
rewrite with a change, say): its token ids are a draft the output is expected to follow in large
part. It is speculation like any other drafter's: the verifier decides every token, so a wrong
prediction costs rejected draft tokens, never a different output.

The alignment rule (``PredictionAligner``): a *pointer* into the prediction marks where the
output stands in it (the prediction's tokens before it are behind the output). It starts at the
prediction's beginning, aligned, before any output. Each new output token then:

1. *follows*: when aligned and it is the prediction's token at the pointer, the pointer moves
   on by one;
2. else *re-aligns*: the output's last n tokens (n from ``max_ngram`` down to 1, longest first)
   are looked up in the prediction; among the occurrences of the longest n found, the nearest
   one whose last token lies at or after the pointer wins (the output skipped a span that the
   prediction has: a deletion), else the nearest one before it (the output repeats earlier
   text). The pointer moves to just after it. A single token (n = 1) re-aligns only ahead of
   the pointer and at most ``unigram_reach`` tokens ahead (a common token far away says
   little);
3. else the output left the prediction (an insertion, or a prediction unrelated to it): the
   request is *not aligned*, and the pointer stays where the output left, so that the output
   rejoining the prediction there (the end of an insertion) re-aligns at once by rule 2.

Aligned, the draft is the prediction's next k tokens from the pointer; not aligned (or at the
prediction's end), there is none. Emitted tokens are never taken back, so the aligner reads
each output token once (O(1) while it follows; a re-alignment reads the occurrences of the
output's last two tokens in the prediction).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field

PREDICTION = "prediction"
"""The Predicted Outputs drafter's name, wherever a drafter is named (requests, policies,
statistics, usage)."""


@dataclass
class PredictionAligner:
    """One request's prediction and where its output stands in it (module docstring)."""

    prediction: tuple[int, ...]
    """The prediction's token ids."""
    max_ngram: int = 4
    """Longest output tail looked up to re-align."""
    unigram_reach: int = 16
    """A single token re-aligns at most this many tokens ahead of the pointer."""
    scan: int = 256
    """A re-alignment reads at most this many occurrences of the output's last two tokens, those
    nearest the pointer (a prediction that repeats a pair thousands of times costs no more)."""
    pointer: int = 0
    """Index of the prediction's next token: the output stands before it."""
    aligned: bool = True
    """The output's last token was the prediction's (or there is no output yet): it drafts."""
    seen: int = 0
    """Output tokens taken in."""
    hits: list[bool] = field(default_factory=list)
    """Output position -> the draft before it proposed that token first."""
    _where: dict[int, list[int]] | None = field(default=None, init=False, repr=False)
    """Token -> its positions in the prediction, ascending (built at the first re-alignment)."""
    _pairs: dict[tuple[int, int], list[int]] = field(default_factory=dict, init=False,
                                                     repr=False)
    """Two tokens -> the positions of the second where the pair occurs, ascending (built with
    ``_where``): a re-alignment on two or more tokens reads only these."""

    def extend(self, output: Sequence[int]) -> None:
        """Take in the output's tokens since the last call (``output``: all of it so far)."""
        for i in range(self.seen, len(output)):
            self._step(output, i)
        self.seen = max(self.seen, len(output))

    def _step(self, output: Sequence[int], i: int) -> None:
        """Move the pointer over output token ``i``."""
        t, p, pred = output[i], self.pointer, self.prediction
        follows = p < len(pred) and pred[p] == t
        self.hits.append(self.aligned and follows)
        if self.aligned and follows:
            self.pointer = p + 1
            return
        at = self._realign(output, i)
        self.aligned = at is not None
        if at is not None:
            self.pointer = at + 1

    def _realign(self, output: Sequence[int], i: int) -> int | None:
        """The prediction position of output token ``i`` by rule 2 (None: none)."""
        pred, p = self.prediction, self.pointer
        if self._where is None:
            self._where = {}
            for j, tok in enumerate(pred):
                self._where.setdefault(tok, []).append(j)
                if j:
                    self._pairs.setdefault((pred[j - 1], tok), []).append(j)
        tail = output[max(0, i - self.max_ngram + 1):i + 1]
        longest, found = 1, []
        pairs = self._pairs.get(tuple(tail[-2:]), []) if len(tail) > 1 else []
        if len(pairs) > self.scan:
            at = bisect.bisect_left(pairs, p)
            pairs = pairs[max(0, at - self.scan // 2):at + self.scan // 2]
        for q in pairs:
            n = 2  # the output tail's match ending at q, longest first
            while n < len(tail) and q - n >= 0 and pred[q - n] == tail[-n - 1]:
                n += 1
            if n > longest:
                longest, found = n, [q]
            elif n == longest:
                found.append(q)
        if found:
            return self._nearest(found)
        spots = self._where.get(output[i], [])
        k = bisect.bisect_left(spots, p)  # a single token: the nearest ahead, within reach
        return spots[k] if k < len(spots) and spots[k] < p + self.unigram_reach else None

    def _nearest(self, found: list[int]) -> int:
        """Of ascending ``found``, the first at or after the pointer, else the last before it."""
        k = bisect.bisect_left(found, self.pointer)
        return found[k] if k < len(found) else found[-1]

    def has_draft(self) -> bool:
        """Whether ``propose`` would draft anything now."""
        return self.aligned and self.pointer < len(self.prediction)

    def propose(self, k: int) -> list[int]:
        """The prediction's next ``k`` tokens from the pointer ([] when not aligned)."""
        if not self.has_draft() or k <= 0:
            return []
        return list(self.prediction[self.pointer:self.pointer + k])

    def score(self, start: int = 0, max_positions: int = 64) -> tuple[int, int]:
        """How well the prediction predicted the output: (matches, positions) over output
        positions ``start`` on (at most the last ``max_positions``): a match is a position whose
        token the draft before it proposed first."""
        n = len(self.hits)
        start = max(0, start, n - max_positions)
        return sum(self.hits[start:n]), max(0, n - start)


def prediction_draft(prediction: Sequence[int], output: Sequence[int], k: int,
                     max_ngram: int = 4) -> list[int]:
    """The next ``k`` tokens of ``prediction`` for ``output`` so far (``PredictionAligner``
    over the whole output at once)."""
    a = PredictionAligner(tuple(prediction), max_ngram=max_ngram)
    a.extend(output)
    return a.propose(k)
