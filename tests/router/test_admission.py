"""Admission by the verifier's KV cache blocks (``KVBudget``)."""

from spin.router.admission import KVBudget


def test_blocks_for_and_watermark() -> None:
    kv = KVBudget(block_size=16, num_blocks=50, free=50)
    assert [kv.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
    assert kv.watermark == 1  # at least one block
    assert KVBudget(16, 1000, 1000).watermark == 10  # 1% of the cache
    assert KVBudget(0, 0, 0).blocks_for(1000) == 0


def test_admits_while_the_free_blocks_allow() -> None:
    kv = KVBudget(block_size=16, num_blocks=100, free=10)
    assert kv.try_admit(100, running=1) == 7  # 101 tokens (its context and one new token)
    assert kv.pending == 7
    assert kv.try_admit(30, running=2) == 2  # 2 + the watermark 1 <= 10 - 7
    assert kv.pending == 9
    assert kv.try_admit(1, running=3) is None  # 1 + 1 > 10 - 9: waits, nothing counted
    assert kv.pending == 9
    assert kv.try_admit(0, running=3) is None


def test_pending_blocks_count_until_the_first_verification() -> None:
    kv = KVBudget(block_size=16, num_blocks=100, free=11)
    a = kv.try_admit(60, running=1)   # 4 blocks
    b = kv.try_admit(40, running=2)   # 3 blocks
    assert (a, b, kv.pending) == (4, 3, 7)
    assert kv.try_admit(60, running=3) is None  # 4 + 1 > 11 - 7
    # a's first verification: the verifier's report now includes its blocks
    kv.verified(a)
    kv.report(free=7, num_blocks=100)
    assert (kv.free, kv.pending) == (7, 3)
    assert kv.try_admit(60, running=3) is None  # 4 + 1 > 7 - 3
    kv.verified(b)
    kv.report(free=5, num_blocks=100)
    assert kv.try_admit(60, running=3) == 4  # 4 + 1 <= 5
    kv.verified(10)  # never below nothing pending
    assert kv.pending == 0


def test_always_admits_with_nothing_running() -> None:
    kv = KVBudget(block_size=16, num_blocks=8, free=0)
    assert kv.try_admit(1000, running=0) == 63  # more than the cache: the verifier decides
    assert kv.pending == 63
    assert kv.try_admit(1, running=1) is None


def test_block_size_zero_admits_everything() -> None:
    kv = KVBudget(block_size=0, num_blocks=0, free=0)
    for n in (0, 10, 10**6):
        assert kv.try_admit(n, running=100) == 0
    assert kv.pending == 0
    kv.report(free=0, num_blocks=0)  # a verifier without blocks reports nothing
    assert kv.try_admit(5, running=1) == 0


def test_a_report_without_blocks_is_ignored() -> None:
    kv = KVBudget(block_size=16, num_blocks=100, free=40)
    kv.report(free=0, num_blocks=0)
    assert (kv.free, kv.num_blocks) == (40, 100)
    kv.report(free=25, num_blocks=120)
    assert (kv.free, kv.num_blocks) == (25, 120)
