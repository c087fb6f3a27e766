"""Suffix decoding: model-free drafts from earlier requests' prompts and outputs.

In the spirit of Arctic's suffix decoding (vLLM's ``suffix`` speculative method): a store of
recent token sequences (prompts and outputs, each request's growing as it is generated), and a
lookup that finds the longest suffix of a request's context (``min_match`` to ``max_match``
tokens) occurring in the store and proposes what followed it: a chain of up to k tokens, or a
tree with a second branch (the most frequent other continuation) when asked for one.

**Why an n-gram index and not a suffix tree.** A suffix trie over windows of ``max_match + k``
tokens keeps one node per distinct window prefix, about ``max_match`` Python objects per stored
token (32 here: several kilobytes per token), and a suffix automaton cannot forget one sequence
(the store evicts). Here each stored position is indexed under the n-grams that end there for
n = ``min_match`` .. ``index_ngram`` (2..4: three entries), each gram keeping its
``candidates`` latest occurrences; a lookup reads the longest indexed gram that occurs, then
extends each of its (at most ``candidates``) occurrences backwards against the stored tokens up
to ``max_match``, and copies k tokens: O(``index_ngram`` + ``candidates`` x ``max_match`` + k)
per call whatever the store's size, and eviction of a sequence removes its entries in
O(its length x ``index_ngram``). Memory: about 0.75 KB per stored token in CPython (the token,
three index entries of a gram tuple, an occurrence tuple and their share of a list; measured by
``tests/engine/test_suffix_decoding.py``), so the default 64K-token budget is about 50 MB.
Arctic's own implementation (the ``arctic-inference`` wheel, a C++ suffix tree) was not used
nor measured: a native dependency for the router, and it has no per-position score (below).

**Which occurrence.** The longest match wins; among the longest, the most recently indexed one.
A draft (``tree``) may be capped at ``spec_factor`` times the match's length (vLLM's
``suffix_decoding_max_spec_factor``: a short match is weak evidence), off by default: with the
learned policy choosing k (its acceptance estimate already shortens drafts that fail), ``spin
bench suffix --split tuning --groups 10 --rounds 2`` measured auto with suffix decoding at
1.728x speculation off with the factor off against 1.383x with a factor of 1 (one run each,
2-core CPU; an earlier evaluation-split run had pointed the same way, 1.53x against 1.26x with
/ without).
With branching, the second branch follows the other first token that most occurrences of the
matched gram go on with (ties: the longer match, then the more recent). A copy stops at the end
of its stored sequence.

**Score.** Like ``PromptLookupIndex.score``: per stored position, whether the lookup from the
tokens before it (over the store as it was when the token came in) predicted it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .tree import TokenTree

SUFFIX_DECODING = "suffix"
"""The suffix drafter's name, wherever a drafter is named (requests, policies, statistics,
reports)."""

Occurrence = tuple[int, int]
"""(a sequence's serial number, where the continuation after the gram starts in it)."""


@dataclass
class _Seq:
    """One stored sequence."""

    key: str
    """The caller's name for it (a request id)."""
    serial: int
    """Unique over the store's life (a sequence stored again after eviction gets a new one)."""
    tokens: list[int] = field(default_factory=list)
    hits: bytearray = field(default_factory=bytearray)
    """Position -> 1 if the lookup from the tokens before it predicted it."""


@dataclass(frozen=True)
class Match:
    """The longest suffix of a context found in the store."""

    length: int
    """Tokens of the context's suffix matched by the best occurrence."""
    best: Occurrence
    """The best occurrence (longest match, then the most recent)."""
    others: tuple[tuple[Occurrence, int], ...]
    """Every occurrence of the matched gram with its match length, latest last."""


class SuffixStore:
    """A bounded store of token sequences with a suffix-match lookup (module doc)."""

    def __init__(self, max_tokens: int = 65536, max_match: int = 32, min_match: int = 2,
                 index_ngram: int = 4, candidates: int = 16, spec_factor: float = 0.0) -> None:
        if not 1 <= min_match <= index_ngram <= max_match:
            raise ValueError(f"want 1 <= min_match ({min_match}) <= index_ngram "
                             f"({index_ngram}) <= max_match ({max_match})")
        if max_tokens < 1 or candidates < 1:
            raise ValueError("max_tokens and candidates must be >= 1")
        self.max_tokens = max_tokens
        self.max_match = max_match
        self.min_match = min_match
        self.index_ngram = index_ngram
        self.candidates = candidates
        self.spec_factor = spec_factor
        """A draft's tokens per matched token, at most (0: no such cap)."""
        self._seqs: OrderedDict[str, _Seq] = OrderedDict()
        """key -> sequence, least recently used first."""
        self._serials: dict[int, _Seq] = {}
        self._index: dict[tuple[int, ...], list[Occurrence]] = {}
        """n-gram -> its latest ``candidates`` occurrences that have a continuation, oldest
        first."""
        self._next = 0
        self.tokens = 0
        """Tokens stored (at most ``max_tokens`` after every call)."""
        self.evicted = 0
        """Sequences evicted so far."""

    def __contains__(self, key: str) -> bool:
        return key in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def length(self, key: str) -> int:
        """Tokens stored of ``key`` (0 when absent)."""
        seq = self._seqs.get(key)
        return len(seq.tokens) if seq is not None else 0

    def sequence(self, key: str) -> list[int]:
        """The tokens stored of ``key`` (empty when absent)."""
        seq = self._seqs.get(key)
        return list(seq.tokens) if seq is not None else []

    # ---- writing ----------------------------------------------------------------------------
    def extend(self, key: str, tokens: Iterable[int], scored: bool = True) -> None:
        """Append tokens to sequence ``key`` (a new one when absent): it becomes the most
        recently used; least recently used sequences are evicted past ``max_tokens``.
        ``scored``: record whether the lookup predicted each token (``score``: a lookup per
        token, ~10 us); else they count as not predicted (a prompt, which nothing scores)."""
        seq = self._seqs.get(key)
        if seq is None:
            seq = self._seqs[key] = _Seq(key, self._next)
            self._serials[seq.serial] = seq
            self._next += 1
        else:
            self._seqs.move_to_end(key)
        toks, index, cap = seq.tokens, self._index, self.candidates
        for t in tokens:
            j = len(toks)
            found = self.match(toks) if scored and j >= self.min_match else None
            seq.hits.append(found is not None and self._copy(found.best, 1) == [t])
            for n in range(self.min_match, min(self.index_ngram, j) + 1):
                occ = index.setdefault(tuple(toks[j - n:j]), [])
                occ.append((seq.serial, j))
                if len(occ) > cap:
                    del occ[0]
            toks.append(t)
            self.tokens += 1
        while self.tokens > self.max_tokens:
            self.forget(next(k for k in self._seqs if k != key) if len(self._seqs) > 1
                        else key)
            self.evicted += 1

    def forget(self, key: str) -> None:
        """Drop sequence ``key`` and its index entries (nothing when absent)."""
        seq = self._seqs.pop(key, None)
        if seq is None:
            return
        del self._serials[seq.serial]
        toks = seq.tokens
        for j in range(self.min_match, len(toks)):
            for n in range(self.min_match, min(self.index_ngram, j) + 1):
                gram = tuple(toks[j - n:j])
                occ = self._index.get(gram)
                if occ is None:
                    continue
                occ[:] = [o for o in occ if o[0] != seq.serial]
                if not occ:
                    del self._index[gram]
        self.tokens -= len(toks)

    # ---- reading ----------------------------------------------------------------------------
    def match(self, context: Sequence[int]) -> Match | None:
        """The longest suffix of ``context`` (``min_match`` .. ``max_match`` tokens) that occurs
        in the store with a continuation; None without one."""
        tail = list(context[-self.max_match:])
        size = len(tail)
        for n in range(min(self.index_ngram, size), self.min_match - 1, -1):
            occ = self._index.get(tuple(tail[size - n:]))
            if not occ:
                continue
            scored = tuple((o, self._extent(o, tail, n)) for o in occ)
            best = max(range(len(scored)), key=lambda i: (scored[i][1], i))
            return Match(scored[best][1], scored[best][0], scored)
        return None

    def _extent(self, occ: Occurrence, tail: list[int], n: int) -> int:
        """How far back from ``occ`` the stored tokens equal ``tail`` (at least ``n``: the gram
        matched)."""
        toks, end = self._serials[occ[0]].tokens, occ[1]
        m, size = n, len(tail)
        while m < size and m < end and toks[end - m - 1] == tail[size - m - 1]:
            m += 1
        return m

    def _copy(self, occ: Occurrence, k: int) -> list[int]:
        return self._serials[occ[0]].tokens[occ[1]:occ[1] + k]

    def _use(self, occ: Occurrence) -> None:
        """The sequence of ``occ`` supplied a draft: it becomes the most recently used."""
        self._seqs.move_to_end(self._serials[occ[0]].key)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the best occurrence of the context's longest
        matching suffix; [] without a match."""
        found = self.match(context)
        if found is None or k <= 0:
            return []
        self._use(found.best)
        return self._copy(found.best, k)

    def alternative(self, found: Match, k: int) -> list[int]:
        """What followed the occurrence of the other first token most occurrences of the
        matched gram go on with (ties: the longer match, then the latest); [] without one."""
        first = self._copy(found.best, 1)
        groups: dict[int, list[tuple[int, int, Occurrence]]] = {}
        for i, (occ, m) in enumerate(found.others):
            t = self._copy(occ, 1)
            if t and t != first:
                groups.setdefault(t[0], []).append((m, i, occ))
        if not groups:
            return []
        top = max(groups.values(), key=lambda g: (len(g), max(g)))
        return self._copy(max(top)[2], k)

    def branches(self, context: Sequence[int]) -> int:
        """Continuations beginning differently that ``tree`` would draft from (0: no match)."""
        found = self.match(context)
        if found is None:
            return 0
        first = self._copy(found.best, 1)
        return 1 + any(self._copy(o, 1) != first for o, _ in found.others)

    def tree(self, context: Sequence[int], k: int, branch: bool) -> TokenTree | None:
        """The draft: the best continuation's chain of up to k tokens and ``spec_factor`` times
        the match's length (the alternative's first token as the first node's runner-up,
        ``TokenTree.second``), or with ``branch`` a tree of both continuations side by side
        (the chain first); None when nothing matches."""
        found = self.match(context) if k > 0 else None
        if found is None:
            return None
        if self.spec_factor > 0:
            k = min(k, max(1, math.ceil(self.spec_factor * found.length)))
        self._use(found.best)
        main, other = self._copy(found.best, k), self.alternative(found, k)
        n = len(main)
        if branch and other:
            return TokenTree(tuple(main + other), tuple(range(-1, n - 1)) + (-1,) + tuple(
                range(n, n + len(other) - 1)))
        second = ((other[0],) + (-1,) * (n - 1)) if other else ()
        return TokenTree(tuple(main), tuple(range(-1, n - 1)), second=second)

    def score(self, key: str, start: int = 1, max_positions: int = 64) -> tuple[int, int]:
        """How well the lookup predicted sequence ``key``: (matches, positions) over its stored
        positions ``start`` on (at most the last ``max_positions``), each predicted from the
        tokens before it; (0, 0) when absent."""
        seq = self._seqs.get(key)
        if seq is None:
            return 0, 0
        n = len(seq.tokens)
        start = max(1, start, n - max_positions)
        return sum(seq.hits[start:n]), max(0, n - start)
