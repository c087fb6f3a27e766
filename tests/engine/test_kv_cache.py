"""The paged KV cache: blocks zeroed when first taken, writes and reads through a view (one
contiguous sequence) or through block tables (gathered), compaction across blocks."""

import pytest
import torch

from spin.engine.kv_cache import CacheFull, KVCache

L, KVH, HD = 2, 1, 2


def make(num_blocks: int = 8, block_size: int = 4, max_seqs: int = 3) -> KVCache:
    return KVCache(num_layers=L, num_blocks=num_blocks, kv_heads=KVH, head_dim=HD,
                   max_seqs=max_seqs, block_size=block_size)


def values(seq: int, positions: range) -> torch.Tensor:
    """Distinct keys for (sequence, position): [1, n, KVH, HD]."""
    p = torch.tensor(list(positions), dtype=torch.float32)
    return torch.stack([1000.0 * (seq + 1) + p, -p], -1)[None, :, None, :].expand(1, -1, KVH, HD)


def feed(c: KVCache, seqs: list[int], sizes: list[int]):
    """Reserve, locate and write ``sizes[i]`` new tokens for each sequence (as a forward does),
    then commit them; the ``Paged`` of the write and what each layer wrote."""
    for s, n in zip(seqs, sizes):
        c.reserve(s, c.lengths[s] + n)
    lq = max(sizes)
    paged = c.locate(seqs, sizes, lq)
    k = torch.zeros(len(seqs), lq, KVH, HD)
    for i, (s, n) in enumerate(zip(seqs, sizes)):
        k[i, :n] = values(s, range(c.lengths[s], c.lengths[s] + n))[0]
    for layer in range(L):
        c.write(layer, paged, k + layer, -(k + layer))
    for s, n in zip(seqs, sizes):
        c.commit(s, c.lengths[s] + n)
    return paged


def check_read(c: KVCache, seqs: list[int]) -> None:
    """Every layer reads back what was written at each sequence's committed positions."""
    paged = c.locate(seqs, [0] * len(seqs), 1)
    for layer in range(L):
        keys, vals = c.read(layer, paged)                                       # [B, KVH, Lk, HD]
        assert keys.shape == (len(seqs), KVH, paged.lk, HD)
        for i, s in enumerate(seqs):
            want = values(s, range(c.lengths[s]))[0].transpose(0, 1) + layer  # [KVH, n, HD]
            assert torch.equal(keys[i, :, :c.lengths[s]], want)
            assert torch.equal(vals[i, :, :c.lengths[s]], -want)


def test_sizes_and_usage() -> None:
    c = make()
    assert KVCache.bytes_per_token(L, KVH, HD, torch.float32) == 2 * L * KVH * HD * 4
    assert KVCache.bytes_per_token(L, KVH, HD, torch.bfloat16) == 2 * L * KVH * HD * 2
    assert c.nbytes == 8 * 4 * KVCache.bytes_per_token(L, KVH, HD, torch.float32)
    assert c.k.shape == (L, 8, 4, KVH, HD) and c.usage == 0.0
    s = c.blocks.admit("a")
    c.reserve(s, 9)
    assert c.usage == 3 / 8
    c.commit(s, 5)
    assert c.usage == 2 / 8 and c.lengths[s] == 5
    c.rollback(s, 0)
    assert c.usage == 0.0
    with pytest.raises(ValueError, match="holds 0"):
        c.rollback(s, 1)


def test_blocks_are_zeroed_when_first_taken() -> None:
    c = make()
    c.k.fill_(float("nan"))
    c.v.fill_(float("nan"))
    s = c.blocks.admit("a")
    c.reserve(s, 6)
    assert torch.equal(c.k[:, :2], torch.zeros(L, 2, 4, KVH, HD))
    assert torch.equal(c.v[:, :2], torch.zeros(L, 2, 4, KVH, HD))
    assert bool(c.k[:, 2:].isnan().all())  # untouched blocks are not written
    with pytest.raises(CacheFull):
        c.reserve(s, 4 * 9)
    assert c.blocks.free_blocks == 6


def test_lone_sequence_is_written_and_read_as_a_view() -> None:
    c = make()
    s = c.blocks.admit("a")
    for n in (6, 1, 1, 3):  # a prefill, decode steps, a chain: always one run of blocks
        paged = feed(c, [s], [n])
        assert paged.run is not None and paged.table is None
        assert c.blocks.contiguous(s) == 0
    check_read(c, [s])
    paged = c.locate([s], [0], 1)
    keys, values, start = paged.run
    assert start == 11 and paged.lk == 11
    assert keys.data_ptr() == c.k.data_ptr() and values.data_ptr() == c.v.data_ptr()  # views
    assert keys.shape[:2] == (c.k.shape[0], 11 + (-11) % c.block_size)


def test_interleaved_sequences_are_gathered_through_block_tables() -> None:
    c = make(num_blocks=12, block_size=2)
    a, b = c.blocks.admit("a"), c.blocks.admit("b")
    for sizes in ([3, 1], [1, 2], [2, 2], [1, 3]):  # ragged batches: blocks interleave
        paged = feed(c, [a, b], sizes)
        assert paged.run is None
    assert c.blocks.contiguous(a) is None and c.blocks.contiguous(b) is None
    check_read(c, [a, b])
    check_read(c, [b])  # one scattered sequence alone is gathered too
    assert c.locate([b], [0], 1).run is None
    check_read(c, [a])


def test_view_and_gather_read_the_same_entries() -> None:
    c = make()
    a, b = c.blocks.admit("a"), c.blocks.admit("b")
    feed(c, [a], [7])  # contiguous
    feed(c, [b], [2])
    alone = c.locate([a], [0], 1)
    together = c.locate([a, b], [0, 0], 1)
    assert alone.run is not None and together.run is None
    for layer in range(L):
        k1, v1 = c.read(layer, alone)
        k2, v2 = c.read(layer, together)
        assert torch.equal(k1[0], k2[0]) and torch.equal(v1[0], v2[0])


def test_compact_moves_entries_of_every_layer_across_blocks() -> None:
    c = make(num_blocks=8, block_size=2)
    s = c.blocks.admit("a")
    c.reserve(s, 8)
    flat = c.k[:, :4].flatten(1, 2)  # positions 0..7 of the lone run, [L, 8, KVH, HD]
    flat[..., 0] = torch.arange(8.0)[None, :, None]
    c.v[:, :4].flatten(1, 2)[..., 0] = -torch.arange(8.0)[None, :, None]
    c.compact(s, [4, 6, 7], start=1)  # a tree path's nodes into place after the context
    for layer in range(L):
        assert c.k[layer, :4].flatten(0, 1)[:, 0, 0].tolist() == [0, 4, 6, 7, 4, 5, 6, 7]
        assert c.v[layer, :4].flatten(0, 1)[1:4, 0, 0].tolist() == [-4, -6, -7]
    before = c.k.clone()
    c.compact(s, [2, 3], start=2)  # already in place: nothing moves
    c.compact(s, [], start=0)
    # blocks never taken hold uninitialised memory, which may be NaN: NaN equals NaN here
    torch.testing.assert_close(c.k, before, rtol=0, atol=0, equal_nan=True)
