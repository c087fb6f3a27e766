"""Prompt lookup: the scan, its score, and the incremental index that must answer the same."""

from __future__ import annotations

import random

from spin.engine.prompt_lookup import PromptLookupIndex, prompt_lookup


def _scan_score(ctx: list[int], start: int, max_positions: int = 64) -> tuple[int, int]:
    """The score by definition: each position predicted by a scan of the tokens before it."""
    start = max(1, start, len(ctx) - max_positions)
    hits = sum(prompt_lookup(ctx[:j], 1)[:1] == [ctx[j]] for j in range(start, len(ctx)))
    return hits, max(0, len(ctx) - start)


def _index(ctx: list[int]) -> PromptLookupIndex:
    index = PromptLookupIndex()
    index.extend(ctx)
    return index


def test_prompt_lookup_proposes_what_followed_the_latest_match() -> None:
    assert prompt_lookup([1, 2, 3, 4, 1, 2], k=3) == [3, 4, 1]
    assert prompt_lookup([5, 6, 7, 9, 5, 6, 8, 5, 6], k=2) == [8, 5]  # latest match wins
    assert prompt_lookup([1, 2, 3, 9, 2, 3], k=2) == [9, 2]  # longest n-gram first
    assert prompt_lookup([1, 2, 3], k=4) == []
    assert prompt_lookup([7, 7], k=4) == [7, 7, 7, 7]  # a run goes on
    assert prompt_lookup([1, 2, 3, 1, 2], k=5) == [3, 1, 2, 3, 1]  # the copy reads its own tokens
    assert prompt_lookup([4, 1, 2, 1, 2], k=3) == [1, 2, 1]  # latest match: period 2


def test_the_score_counts_what_the_lookup_would_have_proposed() -> None:
    ctx = [1, 2, 3, 1, 2, 3, 1, 2, 4]
    # positions 4..8 (tokens 2 3 1 2 4): the lookup proposes 2, 3, 1, 2, 3 from what precedes each
    assert _index(ctx).score(start=4) == (4, 5)
    assert _index(ctx).score(start=4, max_positions=2) == (1, 2)  # the last two only
    assert _index([5, 6, 7]).score(start=1) == (0, 2)  # nothing repeats


def test_the_index_answers_what_the_scan_answers_as_the_context_grows() -> None:
    rng = random.Random(0)
    for trial in range(30):
        vocab = rng.choice((3, 6, 50))  # small vocabularies repeat (runs, periods), large do not
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(1, 90))]
        if trial % 3 == 0:  # a loop at the end, as greedy decoding falls into
            ctx += ctx[-5:] * 4
        index, seen = PromptLookupIndex(), 0
        while seen < len(ctx):
            step = rng.randrange(1, 6)  # tokens arrive a step (a few) at a time
            index.extend(ctx[seen:seen + step])
            seen = min(len(ctx), seen + step)
            prefix = ctx[:seen]
            assert len(index) == seen
            assert index.has_match() == bool(prompt_lookup(prefix, 1)), prefix
            for k in (1, 4, 8):
                assert index.propose(k) == prompt_lookup(prefix, k), (prefix, k)
            for start in (1, seen // 2, seen - 3, seen + 2):
                assert index.score(start) == _scan_score(prefix, start), (prefix, start)
        assert index.score(1, max_positions=8) == _scan_score(ctx, 1, max_positions=8)
