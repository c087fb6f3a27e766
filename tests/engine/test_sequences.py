"""Per-request contexts over a paged cache: (keep, delta) updates keep the valid cache prefix."""

import pytest
import torch

from spin.engine.kv_cache import CacheFull, KVCache
from spin.engine.sequences import Sequences


def make(max_seqs: int = 3, num_blocks: int = 16, seed_offset: int = 0) -> Sequences:
    cache = KVCache(num_layers=1, num_blocks=num_blocks, kv_heads=1, head_dim=2,
                    max_seqs=max_seqs, block_size=4)
    return Sequences(cache, seed_offset)


def run(seqs: Sequences, rid: str, drafted: tuple[int, ...] = ()) -> None:
    """What a forward leaves: the cache holds the whole context (a drafter's prefill), then
    the chain it drafted past it."""
    s = seqs[rid]
    n = len(s.context) + len(drafted)
    seqs.cache.reserve(s.seq, n)
    seqs.cache.commit(s.seq, n)
    s.drafted = list(drafted)


def length(seqs: Sequences, rid: str) -> int:
    return seqs.cache.lengths[seqs[rid].seq]


CTX = list(range(1, 11))  # 10 tokens


def test_a_new_request_feeds_its_whole_context() -> None:
    seqs = make()
    assert "a" not in seqs and seqs.held("a") == 0 and len(seqs) == 0
    s = seqs.apply("a", 0, CTX, seed=5)
    assert "a" in seqs and seqs["a"] is s and len(seqs) == 1 and list(seqs) == [s]
    assert s.context == CTX and seqs.held("a") == 10 and length(seqs, "a") == 0
    assert seqs.feed(s) == CTX
    assert seqs.cache.blocks.owner(s.seq) == "a"


def test_appended_tokens_keep_the_cache() -> None:
    seqs = make()
    seqs.apply("a", 0, CTX)
    run(seqs, "a")
    s = seqs.apply("a", 10, [11, 12])
    assert s.context == CTX + [11, 12] and length(seqs, "a") == 10
    assert seqs.feed(s) == [11, 12]


def test_nothing_new_still_leaves_the_last_token_to_feed() -> None:
    seqs = make()
    seqs.apply("a", 0, CTX)
    run(seqs, "a")
    s = seqs.apply("a", 10, [])
    assert length(seqs, "a") == 9 and seqs.feed(s) == [10]


def test_a_shorter_keep_keeps_what_the_delta_repeats() -> None:
    seqs = make()
    seqs.apply("a", 0, CTX)
    run(seqs, "a")
    s = seqs.apply("a", 6, [7, 8, 99, 100])  # tokens 7, 8 held again, then a new ending
    assert s.context == CTX[:8] + [99, 100] and length(seqs, "a") == 8
    assert seqs.feed(s) == [99, 100]
    run(seqs, "a")
    s = seqs.apply("a", 3, [])  # the context shrinks
    assert s.context == CTX[:3] and length(seqs, "a") == 2 and seqs.feed(s) == [3]


def test_resending_the_whole_context_keeps_the_cache() -> None:
    """keep=0 with the full context (a resync, or a caller that never sends deltas)."""
    seqs = make()
    seqs.apply("a", 0, CTX)
    run(seqs, "a")
    s = seqs.apply("a", 0, CTX + [11])
    assert length(seqs, "a") == 10 and seqs.feed(s) == [11]
    s = seqs.apply("a", 0, [1, 2, 50] + CTX[3:] + [11])  # differs at position 2
    assert length(seqs, "a") == 2 and seqs.feed(s) == [50] + CTX[3:] + [11]


def test_a_drafted_chain_that_the_delta_confirms_is_kept() -> None:
    seqs = make()
    seqs.apply("a", 0, CTX)
    run(seqs, "a", drafted=(20, 21, 22))
    assert length(seqs, "a") == 13
    s = seqs.apply("a", 10, [20, 21, 30])  # two accepted, then the correction
    assert s.context == CTX + [20, 21, 30] and s.drafted == []
    assert length(seqs, "a") == 12 and seqs.feed(s) == [30]
    run(seqs, "a", drafted=(40, 41))
    s = seqs.apply("a", 13, [40, 41, 42])  # all accepted and the bonus token
    assert length(seqs, "a") == 15 and seqs.feed(s) == [42]
    run(seqs, "a", drafted=(50,))
    s = seqs.apply("a", 16, [51])  # rejected at once: the chain is dropped
    assert length(seqs, "a") == 16 and seqs.feed(s) == [51]
    run(seqs, "a", drafted=(60, 61))
    s = seqs.apply("a", 17, [])  # nothing emitted elsewhere: the chain is not context
    assert length(seqs, "a") == 16 and seqs.feed(s) == [51]


def test_holds_and_bad_keeps() -> None:
    seqs = make()
    assert seqs.holds("new", 0) and not seqs.holds("new", 3)
    with pytest.raises(ValueError, match="keep=3 but 0 tokens are held"):
        seqs.apply("new", 3, [1])
    assert "new" not in seqs
    seqs.apply("a", 0, CTX)
    run(seqs, "a")
    assert seqs.holds("a", 0) and seqs.holds("a", 10)
    assert not seqs.holds("a", 11) and not seqs.holds("a", -1)
    with pytest.raises(ValueError, match="10 tokens are held"):
        seqs.apply("a", 11, [5])
    assert seqs["a"].context == CTX and length(seqs, "a") == 10  # untouched
    # the caller resyncs with the whole context
    s = seqs.apply("a", 0, CTX + [11, 12])
    assert s.context == CTX + [11, 12] and length(seqs, "a") == 10


def test_an_empty_context_is_refused_without_a_trace() -> None:
    seqs = make()
    free = seqs.cache.blocks.free_seqs
    with pytest.raises(ValueError, match="empty"):
        seqs.apply("e", 0, [])
    assert "e" not in seqs and seqs.cache.blocks.free_seqs == free
    seqs.apply("a", 0, CTX)
    with pytest.raises(ValueError, match="empty"):
        seqs.apply("a", 0, [])
    assert seqs["a"].context == CTX  # untouched


def test_a_seeded_generator_draws_by_position_not_by_history() -> None:
    """A step redone at the same context length draws the same numbers (a preempted
    verification, a draft the verifier never saw); another position draws others."""
    seqs = make(seed_offset=1)
    s = seqs.apply("a", 0, CTX, seed=7)
    first = torch.rand(4, generator=seqs.generator(s))
    torch.rand(100, generator=s.generator)  # draws of a step that was dropped
    assert torch.equal(torch.rand(4, generator=seqs.generator(s)), first)
    seqs.apply("a", len(CTX), [5])
    assert not torch.equal(torch.rand(4, generator=seqs.generator(s)), first)
    other = make(seed_offset=0)  # the verifier's stream differs from the drafter's
    assert not torch.equal(torch.rand(4, generator=other.generator(other.apply("a", 0, CTX,
                                                                                seed=7))), first)


def test_evict_keeps_context_and_generator() -> None:
    seqs = make(seed_offset=1)
    s = seqs.apply("a", 0, CTX, seed=7)
    want = torch.Generator().manual_seed(8)  # the seed plus this model's offset
    assert torch.equal(torch.rand(3, generator=s.generator), torch.rand(3, generator=want))
    run(seqs, "a", drafted=(20, 21))
    free = seqs.cache.blocks.free_blocks
    gen = s.generator
    seqs.evict("a")
    assert seqs.cache.blocks.free_blocks == free + 3 and length(seqs, "a") == 0
    assert "a" in seqs and s.context == CTX and s.drafted == [] and s.generator is gen
    assert seqs.cache.blocks.owner(s.seq) == "a"
    assert torch.equal(torch.rand(3, generator=s.generator), torch.rand(3, generator=want))
    s = seqs.apply("a", 10, [11])  # the next step recomputes the whole cache
    assert seqs.feed(s) == CTX + [11] and s.generator is gen


def test_admission_order_clock_and_release() -> None:
    seqs = make(max_seqs=2)
    a = seqs.apply("a", 0, [1])
    seqs.tick()
    b = seqs.apply("b", 0, [2])
    assert a.admitted < b.admitted and (a.last_used, b.last_used) == (0, 1)
    assert seqs.tick() == 2
    seqs.apply("a", 1, [3])
    assert a.last_used == 2
    with pytest.raises(CacheFull):
        seqs.apply("c", 0, [4])
    seqs.extend("b", (5, 6))
    assert b.context == [2, 5, 6]
    seqs.release("a")
    seqs.release("a")  # idempotent
    seqs.release("never-seen")
    assert "a" not in seqs and seqs.cache.blocks.free_seqs == 1
    c = seqs.apply("c", 0, [4])
    assert c.seq == a.seq and c.admitted > b.admitted
    seqs.release("b")
    again = seqs.apply("a", 0, [7])  # a released request starts afresh
    assert again is not a and again.context == [7] and again.admitted > c.admitted


def test_seeded_and_unseeded_generators() -> None:
    seqs = make()
    x = seqs.apply("x", 0, [1], seed=3).generator
    y = seqs.apply("y", 0, [1], seed=3).generator
    assert torch.equal(torch.rand(4, generator=x), torch.rand(4, generator=y))
    z = seqs.apply("z", 0, [1]).generator  # from the OS
    assert z.initial_seed() != 3
