"""Prompt lookup: drafting from the request's own context, no model.

``prompt_lookup`` proposes what followed the latest earlier occurrence of the context's last
n-gram, scanning the context (offline users: the zoo's acceptance walk, ``PromptLookupDrafter``).
``PromptLookupIndex`` gives the same proposals for one growing context (a request in the router)
at O(``max_ngram``) per new token, and scores how well the lookup predicted the context itself:
it keeps, per n-gram, where its latest occurrence's continuation starts, and per position
whether the lookup from the tokens before it predicted it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .tree import TokenTree

PROMPT_LOOKUP = "prompt-lookup"
"""The prompt-lookup drafter's name, wherever a drafter is named (requests, policies, statistics,
reports)."""


def prompt_lookup(context: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the context's last n-gram
    (n from ``max_ngram`` down to 1); [] without a match.

    A copy that reaches the end of the context goes on through the tokens it has copied, as an
    LZ77 back-reference may overlap itself: after ``a b c a b`` the match ``a b`` at 0 proposes
    ``c a b c ...``, so a repeating span (a run of one token, a table row, an indent) is drafted
    k tokens ahead instead of only up to the context's end."""
    ctx = list(context)
    for n in range(min(max_ngram, len(ctx) - 1), 0, -1):
        tail = ctx[-n:]
        for start in range(len(ctx) - n - 1, -1, -1):
            if ctx[start:start + n] == tail:
                src = start + n  # < len(ctx): the copy may read what it appends
                for j in range(k):
                    ctx.append(ctx[src + j])
                return ctx[len(context):]
    return []


class PromptLookupIndex:
    """Incremental ``prompt_lookup`` over one context that only grows (a request's prompt and
    generated tokens: emitted tokens are never taken back), and its score on that context."""

    def __init__(self, max_ngram: int = 3) -> None:
        self.max_ngram = max_ngram
        self._tokens: list[int] = []
        self._src: dict[tuple[int, ...], int] = {}
        """n-gram -> where the continuation of its latest occurrence that has one starts"""
        self._alt: dict[tuple[int, ...], int] = {}
        """n-gram -> where the continuation of its latest occurrence that goes on with another
        token than ``_src``'s starts (a second branch for a token tree)"""
        self._hit: list[bool] = []
        """position -> the lookup from the tokens before it predicted it (position 0: False)"""

    def __len__(self) -> int:
        return len(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append the context's next tokens."""
        toks, src, alt = self._tokens, self._src, self._alt
        for t in tokens:
            j = len(toks)
            at = self._match()
            self._hit.append(at is not None and toks[at] == t)
            for n in range(1, min(self.max_ngram, j) + 1):  # the n-grams ending at j - 1
                gram = tuple(toks[j - n:j])
                old = src.get(gram)
                if old is not None and toks[old] != t:  # it went on otherwise last time
                    alt[gram] = old
                src[gram] = j  # now continue at j
            toks.append(t)

    def _gram(self) -> tuple[int, ...] | None:
        """The longest last n-gram with an earlier occurrence."""
        toks = self._tokens
        for n in range(min(self.max_ngram, len(toks) - 1), 0, -1):
            if tuple(toks[-n:]) in self._src:
                return tuple(toks[-n:])
        return None

    def _match(self) -> int | None:
        """Where the continuation of the latest earlier occurrence of the last n-gram starts."""
        gram = self._gram()
        return None if gram is None else self._src[gram]

    def has_match(self) -> bool:
        """Whether ``propose`` would draft anything."""
        return self._match() is not None

    def propose(self, k: int) -> list[int]:
        """``prompt_lookup(context, k)``."""
        at = self._match()
        return [] if at is None else self._copy(at, k)

    def _copy(self, at: int, k: int) -> list[int]:
        toks, out = self._tokens, []
        for j in range(at, at + k):  # the copy may read what it appends
            out.append(toks[j] if j < len(toks) else out[j - len(toks)])
        return out

    def alternative(self, k: int) -> list[int]:
        """A second continuation: what followed the latest earlier occurrence of the matched
        n-gram that went on with another first token than ``propose``'s; [] without one."""
        gram = self._gram()
        at = None if gram is None else self._alt.get(gram)
        return [] if at is None else self._copy(at, k)

    def score(self, start: int = 1, max_positions: int = 64) -> tuple[int, int]:
        """How well prompt lookup predicts the context itself: (matches, positions) over
        positions ``start`` on (at most the last ``max_positions``), each predicted by
        ``prompt_lookup`` from the tokens before it."""
        n = len(self._tokens)
        start = max(1, start, n - max_positions)
        return sum(self._hit[start:n]), max(0, n - start)


def lookup_tree(index: PromptLookupIndex, k: int, branch: bool) -> TokenTree | None:
    """Prompt lookup's draft from ``index``: its chain of k (with the alternative's first token
    as the first node's runner-up, ``TokenTree.second``), or with ``branch`` a tree of both
    continuations side by side (the chain first); None when nothing matches."""
    main = index.propose(k)
    if not main:
        return None
    other = index.alternative(k)
    if branch and other:
        n = len(main)
        return TokenTree(tuple(main + other), tuple(range(-1, n - 1)) + (-1,) + tuple(
            range(n, n + len(other) - 1)))
    second = ((other[0],) + (-1,) * (len(main) - 1)) if other else ()
    return TokenTree(tuple(main), tuple(range(-1, len(main) - 1)), second=second)
