"""Block bookkeeping: blocks taken as a sequence grows and given back when it shrinks or leaves."""

import random

import pytest

from spin.engine.block_manager import BlockManager, CacheFull


def test_bad_sizes_are_refused() -> None:
    for args in ((0, 16, 4), (8, 0, 4), (8, 16, 0)):
        with pytest.raises(ValueError, match="must be > 0"):
            BlockManager(*args)


def test_admit_until_no_sequence_id_then_free() -> None:
    m = BlockManager(num_blocks=8, block_size=4, max_seqs=3)
    seqs = [m.admit(f"r{i}") for i in range(3)]
    assert sorted(seqs) == [0, 1, 2] and m.free_seqs == 0
    assert [m.owner(s) for s in seqs] == ["r0", "r1", "r2"]
    with pytest.raises(CacheFull, match="3 sequences"):
        m.admit("r3")
    m.free(seqs[1])
    assert m.owner(seqs[1]) is None
    assert m.admit("r4") == seqs[1] and m.owner(seqs[1]) == "r4"
    with pytest.raises(KeyError):
        m.free(99)


def test_blocks_are_taken_as_a_sequence_grows() -> None:
    m = BlockManager(num_blocks=8, block_size=4, max_seqs=2)
    s = m.admit("a")
    assert m.tables[s] == [] and m.lengths[s] == 0 and m.free_blocks == 8
    assert m.reserve(s, 1) == [0] and m.free_blocks == 7
    assert m.reserve(s, 4) == [] and m.free_blocks == 7  # still within the first block
    assert m.needed(s, 5) == 1 and m.needed(s, 4) == 0 and m.needed(s, 13) == 3
    assert m.reserve(s, 9) == [1, 2] and m.tables[s] == [0, 1, 2]
    assert m.used_blocks == 3 and m.free_blocks == 5 and m.capacity_tokens == 32
    m.commit(s, 9)
    assert m.lengths[s] == 9 and m.tables[s] == [0, 1, 2]


def test_rollback_past_a_block_boundary_gives_blocks_back() -> None:
    m = BlockManager(num_blocks=8, block_size=4, max_seqs=2)
    s = m.admit("a")
    m.reserve(s, 12)
    m.commit(s, 12)
    m.rollback(s, 9)  # still needs 3 blocks
    assert m.tables[s] == [0, 1, 2] and m.free_blocks == 5
    m.rollback(s, 8)  # exactly two blocks
    assert m.tables[s] == [0, 1] and m.free_blocks == 6 and m.lengths[s] == 8
    m.rollback(s, 0)
    assert m.tables[s] == [] and m.free_blocks == 8
    with pytest.raises(ValueError, match="holds 0"):
        m.rollback(s, 1)


def test_commit_gives_back_reserved_blocks_past_the_length() -> None:
    """A forward reserves for a whole tree, verification commits the accepted path."""
    m = BlockManager(num_blocks=8, block_size=4, max_seqs=2)
    s = m.admit("a")
    m.reserve(s, 14)
    assert m.free_blocks == 4
    m.commit(s, 6)
    assert m.tables[s] == [0, 1] and m.free_blocks == 6 and m.lengths[s] == 6
    with pytest.raises(ValueError, match="outside 0..8"):
        m.commit(s, 9)  # past the blocks it holds


def test_evict_drops_the_cache_and_keeps_the_id() -> None:
    m = BlockManager(num_blocks=8, block_size=4, max_seqs=2)
    s = m.admit("a")
    m.reserve(s, 10)
    m.commit(s, 10)
    m.evict(s)
    assert m.owner(s) == "a" and m.tables[s] == [] and m.lengths[s] == 0
    assert m.free_blocks == 8 and m.free_seqs == 1
    m.free(s)
    assert m.free_seqs == 2 and m.free_blocks == 8
    with pytest.raises(KeyError):
        m.free(s)  # twice
    with pytest.raises(KeyError):
        m.reserve(s, 1)


def test_cache_full_takes_nothing() -> None:
    m = BlockManager(num_blocks=4, block_size=4, max_seqs=2)
    a, b = m.admit("a"), m.admit("b")
    m.reserve(a, 10)  # 3 blocks
    before = (list(m.tables[a]), list(m.tables[b]), m.free_blocks)
    with pytest.raises(CacheFull, match="needs 2 more blocks, 1 are free"):
        m.reserve(b, 5)
    assert (m.tables[a], m.tables[b], m.free_blocks) == before
    assert m.reserve(b, 4) == [3] and m.free_blocks == 0


def test_a_lone_growing_sequence_stays_contiguous() -> None:
    m = BlockManager(num_blocks=16, block_size=2, max_seqs=2)
    s = m.admit("a")
    for n in range(1, 30):
        m.reserve(s, n)
        m.commit(s, n)
        assert m.contiguous(s) == 0
    assert m.tables[s] == list(range(15))
    m.rollback(s, 7)  # blocks 4.. go back; growing again takes them in order
    m.reserve(s, 20)
    assert m.tables[s] == list(range(10)) and m.contiguous(s) == 0


def test_interleaved_sequences_are_scattered_and_a_free_run_is_reused() -> None:
    m = BlockManager(num_blocks=8, block_size=2, max_seqs=2)
    a, b = m.admit("a"), m.admit("b")
    assert m.contiguous(a) is None  # no blocks: nothing to read as a view
    for n in (2, 4, 6):
        m.reserve(a, n)
        m.reserve(b, n)
    assert m.tables[a] == [0, 2, 4] and m.tables[b] == [1, 3, 5]
    assert m.contiguous(a) is None and m.contiguous(b) is None
    m.free(b)
    c = m.admit("c")
    m.reserve(c, 1)
    assert m.tables[c] == [1]
    m.free(a)
    m.reserve(c, 8)  # grows into the blocks a gave back, next block first
    assert m.tables[c] == [1, 2, 3, 4] and m.contiguous(c) == 1


def test_random_walk_against_a_model() -> None:
    """admit / reserve / commit / rollback / evict / free: the free counts always add up, no
    block is held twice, and every sequence holds exactly the blocks its length needs."""
    rng = random.Random(0)
    nb, bs, ms = 24, 4, 5
    m = BlockManager(nb, bs, ms)
    live: dict[int, int] = {}  # seq -> the model's committed length
    reserved: dict[int, int] = {}  # seq -> positions reserved past the length
    for step in range(3000):
        op = rng.choice(["admit", "reserve", "reserve", "commit", "rollback", "evict", "free"])
        if op == "admit":
            if len(live) < ms:
                s = m.admit(f"r{step}")
                assert s not in live
                live[s], reserved[s] = 0, 0
            else:
                with pytest.raises(CacheFull):
                    m.admit("x")
        elif live:
            s = rng.choice(sorted(live))
            if op == "reserve":
                tokens = live[s] + rng.randint(1, 12)
                need = -(-tokens // bs) - len(m.tables[s])
                free = m.free_blocks
                if max(0, need) > free:
                    with pytest.raises(CacheFull):
                        m.reserve(s, tokens)
                    assert m.free_blocks == free
                else:
                    taken = m.reserve(s, tokens)
                    assert len(taken) == max(0, need) and m.free_blocks == free - len(taken)
                    reserved[s] = max(reserved[s], tokens)
            elif op == "commit":
                length = rng.randint(live[s], max(live[s], reserved[s]))
                m.commit(s, length)
                live[s], reserved[s] = length, length
            elif op == "rollback":
                length = rng.randint(0, live[s])
                m.rollback(s, length)
                live[s], reserved[s] = length, length
            elif op == "evict":
                m.evict(s)
                assert m.owner(s) is not None
                live[s], reserved[s] = 0, 0
            else:
                m.free(s)
                del live[s], reserved[s]
        held = [b for s in live for b in m.tables[s]]
        assert len(held) == len(set(held)) and all(0 <= b < nb for b in held)
        assert m.free_blocks + len(held) == nb and m.used_blocks == len(held)
        assert m.free_seqs + len(live) == ms
        for s, length in live.items():
            assert m.lengths[s] == length
            assert len(m.tables[s]) == -(-max(length, reserved[s]) // bs)
    for s in list(live):
        m.free(s)
    assert m.free_blocks == nb and m.free_seqs == ms
