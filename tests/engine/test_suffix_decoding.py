"""Suffix decoding's store: its lookups against a brute-force scan, its trees, its score and its
memory bound."""

from __future__ import annotations

import random
import sys
import tracemalloc

import pytest

from spin.engine.suffix_decoding import SuffixStore


def _brute(seqs: list[list[int]], ctx: list[int], k: int, max_match: int = 32,
           min_match: int = 2) -> list[int]:
    """By definition: over every stored position with a continuation (in the order they were
    stored), the longest suffix of ``ctx`` (min_match..max_match tokens) that ends there; the
    latest of the longest wins; what followed it, up to k tokens."""
    best: tuple[int, list[int]] | None = None
    for seq in seqs:
        for end in range(1, len(seq)):
            m = 0
            while (m < min(max_match, len(ctx)) and m < end
                   and seq[end - m - 1] == ctx[len(ctx) - m - 1]):
                m += 1
            if m >= min_match and (best is None or m >= best[0]):
                best = (m, seq[end:end + k])
    return best[1] if best is not None else []


def _store(seqs: list[list[int]], **kw: int) -> SuffixStore:
    store = SuffixStore(**kw)
    for i, s in enumerate(seqs):
        store.extend(f"r{i}", s)
    return store


def test_the_longest_match_and_then_the_latest_one_is_copied() -> None:
    store = _store([[1, 2, 3, 4, 5, 6], [9, 3, 4, 7, 8], [0, 2, 3, 4, 9, 9]])
    assert store.propose([7, 2, 3, 4], k=3) == [9, 9]  # the latest of the longest; stops at its end
    assert store.propose([1, 2, 3, 4], k=3) == [5, 6]  # 4 tokens beat 3
    assert store.propose([3, 4], k=2) == [9, 9]  # equal lengths: the latest
    assert store.propose([5, 4], k=2) == []  # one token is too short
    assert store.propose([9, 9], k=2) == []  # no continuation after it


@pytest.mark.parametrize("seed", range(6))
def test_proposals_equal_a_brute_force_scan(seed: int) -> None:
    rng = random.Random(seed)
    vocab = 3 + seed % 3  # small vocabularies: long repeated stretches
    seqs = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 60))] for _ in range(5)]
    store = _store(seqs, candidates=10_000)  # no occurrence list is capped here
    for _ in range(200):
        ctx = [rng.randrange(vocab) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(1, 8)
        assert store.propose(ctx, k) == _brute(seqs, ctx, k), (ctx, k)


def test_max_match_caps_how_far_back_a_match_is_compared() -> None:
    seqs = [[5, 1, 2, 3, 4, 8], [6, 1, 2, 3, 4, 9]]
    store = _store(seqs, max_match=4, index_ngram=4)
    assert store.propose([5, 1, 2, 3, 4], k=1) == [9]  # both match 4: the latest
    store = _store(seqs, max_match=5, index_ngram=4)
    assert store.propose([5, 1, 2, 3, 4], k=1) == [8]  # the 5th token back decides


def test_a_tree_branches_to_the_most_frequent_other_continuation() -> None:
    store = _store([[1, 2, 8, 8], [1, 2, 7, 7], [1, 2, 8, 5], [1, 2, 6, 6]])
    assert store.branches([1, 2]) == 2
    chain = store.tree([1, 2], k=2, branch=False)
    assert chain is not None and chain.tokens == (6, 6) and chain.second == (8, -1)
    tree = store.tree([1, 2], k=2, branch=True)
    assert tree is not None
    # 8 follows twice (7 once, later): the latest of its occurrences
    assert tree.tokens == (6, 6, 8, 5) and tree.parents == (-1, 0, -1, 2)
    assert store.tree([4, 4], k=2, branch=True) is None and store.branches([4, 4]) == 0
    assert _store([[1, 2, 3], [1, 2, 3]]).branches([1, 2]) == 1


def test_a_draft_is_at_most_spec_factor_times_the_match() -> None:
    store = _store([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]], spec_factor=1)
    assert store.tree([2, 3], k=6, branch=False).tokens == (4, 5)  # 2 matched
    assert store.tree([1, 2, 3], k=6, branch=False).tokens == (4, 5, 6)
    assert store.propose([2, 3], k=6) == [4, 5, 6, 7, 8, 9]  # the lookup itself is not capped
    store.spec_factor = 0.0
    assert store.tree([2, 3], k=6, branch=False).tokens == (4, 5, 6, 7, 8, 9)


def test_a_sequence_matches_its_own_earlier_text_as_it_grows() -> None:
    store = SuffixStore()
    store.extend("a", [4, 5, 6, 7, 4, 5])
    assert store.propose([4, 5], k=2) == [6, 7]
    store.extend("a", [6])
    assert store.propose([9, 5, 6], k=3) == [7, 4, 5]


def test_the_score_counts_what_the_lookup_would_have_proposed() -> None:
    store = SuffixStore()
    store.extend("a", [1, 2, 3, 4, 9])
    store.extend("b", [0, 2, 3, 4, 5, 2, 3, 4])
    # b's positions 3..7 (tokens 4 5 2 3 4): the lookup from what precedes each proposed
    # 4 (a's "2 3"), 9 (a's "2 3 4"), nothing, nothing, 4 (a's and b's own "2 3")
    assert store.score("b", start=3) == (2, 5)
    assert store.score("b", start=3, max_positions=2) == (1, 2)
    assert store.score("missing") == (0, 0)


def test_a_repeated_request_is_drafted_from_the_earlier_output() -> None:
    rng = random.Random(0)
    prompt = [rng.randrange(4096) for _ in range(50)]
    output = [rng.randrange(4096) for _ in range(40)]
    store = SuffixStore()
    store.extend("first", prompt + output)
    store.extend("second", prompt)
    assert store.tree(prompt, k=8, branch=False).tokens == tuple(output[:8])
    store.extend("second", output)
    hits, positions = store.score("second", start=len(prompt))
    assert (hits, positions) == (40, 40)  # every output token was predicted


def test_eviction_keeps_the_store_within_its_token_budget() -> None:
    rng = random.Random(1)
    store = SuffixStore(max_tokens=500)
    for i in range(40):
        store.extend(f"r{i}", [rng.randrange(50) for _ in range(rng.randrange(20, 120))])
        assert store.tokens <= 500
        assert store.tokens == sum(store.length(f"r{j}") for j in range(i + 1))
    assert store.evicted > 0 and "r0" not in store and "r39" in store
    # the index holds only occurrences of stored sequences: forgetting all empties it
    for i in range(40):
        store.forget(f"r{i}")
    assert store.tokens == 0 and not store._index and not store._serials


def test_the_least_recently_used_sequence_goes_first() -> None:
    store = SuffixStore(max_tokens=12)
    store.extend("a", [1, 2, 3, 4])
    store.extend("b", [5, 6, 7, 8])
    store.extend("c", [9, 10, 11, 12])
    assert store.propose([1, 2], k=1) == [3]  # a supplied a draft: now the most recent
    store.extend("d", [13, 14])
    assert "b" not in store and all(x in store for x in "acd")


def test_memory_per_stored_token_is_what_the_module_says() -> None:
    """About 0.75 KB per token (module doc): checked loosely, at under 1 KB."""
    rng = random.Random(2)
    seqs = [[rng.randrange(4096) for _ in range(500)] for _ in range(20)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    store = _store(seqs, max_tokens=20_000)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert store.tokens == 10_000
    per_token = used / store.tokens
    print(f"{per_token:.0f} bytes per stored token", file=sys.stderr)
    assert per_token < 1024


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        SuffixStore(min_match=3, index_ngram=2)
    with pytest.raises(ValueError):
        SuffixStore(max_tokens=0)


def test_unscored_tokens_are_stored_and_matched_but_count_as_unpredicted() -> None:
    store = SuffixStore()
    store.extend("a", [1, 2, 3, 4, 1, 2, 3, 4], scored=False)
    assert store.score("a") == (0, 7)  # the repeat would have been predicted
    assert store.propose([9, 1, 2], 2) == [3, 4]  # indexed as ever
    store.extend("a", [1, 2, 3])
    assert store.score("a", start=8) == (3, 3)
