"""The prefix cache: full context blocks shared across sequences by reference count, kept idle
after their last holder, evicted least recently released first, never written while shared;
and through the verifier and a drafter, outputs equal to the same runs without it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from spin.engine.block_manager import BlockManager, CacheFull
from spin.engine.drafter import DraftRequest, ModelDrafter
from spin.engine.model_runner import ModelRunner
from spin.engine.prefix_cache import PrefixCache
from spin.engine.tree import TokenTree
from spin.engine.verifier import Verifier, VerifyRequest
from spin.zoo.distill import greedy_continue

BS = 4
EMPTY = TokenTree((), ())
TBLOCK = 2 * 8 * 6 * 64 * 4 * 16  # one KV block of the demo target in fp32 (16 tokens)


class _Pool:
    """A block manager and what each block "holds": the token written at each offset (a KV
    cache whose entries are the tokens themselves)."""

    def __init__(self, num_blocks: int, max_seqs: int = 4, prefix_caching: bool = True) -> None:
        self.m = BlockManager(num_blocks, BS, max_seqs, prefix_caching)
        self.data = [[None] * BS for _ in range(num_blocks)]

    def write(self, seq: int, tokens: list[int]) -> None:
        """A forward: ``tokens`` at the positions after the sequence's length, committed."""
        m, start = self.m, self.m.lengths[seq]
        m.reserve(seq, start + len(tokens))
        for i, t in enumerate(tokens):
            block = m.tables[seq][(start + i) // BS]
            assert m.prefix is None or not m.prefix.registered(block), "wrote a cached block"
            self.data[block][(start + i) % BS] = t
        m.commit(seq, start + len(tokens))

    def held(self, seq: int) -> list[int]:
        m = self.m
        return [self.data[m.tables[seq][p // BS]][p % BS] for p in range(m.lengths[seq])]

    def check(self) -> None:
        m = self.m
        refs = [0] * m.num_blocks
        for s in m._owner:
            for b in m.tables[s]:
                refs[b] += 1
        assert refs == m._refs
        assert m.free_blocks == sum(r == 0 for r in refs)


def test_a_second_context_attaches_the_first_ones_full_blocks() -> None:
    p = _Pool(16)
    a = p.m.admit("a")
    ctx = list(range(100, 111))  # 11 tokens: two full blocks and three tokens
    p.write(a, ctx[:-1])
    p.m.publish(a, ctx)
    assert len(p.m.prefix) == 2
    b = p.m.admit("b")
    other = ctx[:9] + [7, 8, 9]
    assert p.m.match(b, other) == 8  # blocks 0 and 1; block 2 holds other tokens
    assert p.m.tables[b] == p.m.tables[a][:2] and p.m._refs[p.m.tables[a][0]] == 2
    assert p.held(b) == other[:8]
    p.write(b, other[8:-1])
    assert p.held(b) == other[:-1] and p.held(a) == ctx[:-1]
    assert (p.m.prefix.queries, p.m.prefix.hits) == (12, 8)
    assert p.m.used_blocks == 3 + 1  # a's three, b's own third: the shared two count once
    p.check()


def test_a_match_leaves_the_last_token_to_feed() -> None:
    p = _Pool(16)
    a = p.m.admit("a")
    ctx = list(range(8))
    p.write(a, ctx)
    p.m.publish(a, ctx + [9])
    b = p.m.admit("b")
    assert p.m.match(b, ctx) == 4  # 8 tokens cached, but the 8th must be fed: one block


def test_released_blocks_stay_idle_and_the_least_recent_go_first() -> None:
    p = _Pool(6)
    a = p.m.admit("a")
    ctx = list(range(13))
    p.write(a, ctx[:-1])
    p.m.publish(a, ctx)
    first = list(p.m.tables[a])
    p.m.free(a)
    assert p.m.free_blocks == 6 and p.m.prefix.idle == 3
    c = p.m.admit("c")
    p.write(c, [50] * 12)  # needs 3 blocks: the 3 never-used ones first
    assert not set(p.m.tables[c]) & set(first) and p.m.prefix.idle == 3
    p.write(c, [51] * 4)  # one more: the least recently released idle block, a's last one
    assert p.m.tables[c][-1] == first[2] and p.m.prefix.idle == 2
    d = p.m.admit("d")
    assert p.m.match(d, ctx) == 8  # a's first two blocks are still there
    assert p.held(d) == ctx[:8]
    p.check()


def test_a_rollback_into_a_shared_block_leaves_it_to_the_others() -> None:
    p = _Pool(16)
    a, b = p.m.admit("a"), p.m.admit("b")
    ctx = list(range(30, 43))
    p.write(a, ctx[:-1])
    p.m.publish(a, ctx)
    assert p.m.match(b, ctx) == 12
    p.m.rollback(b, 6)  # into block 1, which a holds too: b drops it and recomputes from 4
    assert p.m.lengths[b] == 4 and p.m.tables[b] == p.m.tables[a][:1]
    p.write(b, [1, 2, 3])
    assert p.held(a) == ctx[:-1] and p.held(b) == ctx[:4] + [1, 2, 3]
    p.m.rollback(a, 5)  # a alone holds block 1 now: unregistered, kept, overwritten
    assert p.m.lengths[a] == 5 and len(p.m.prefix) == 2 and p.m.prefix.idle == 1
    p.write(a, [9, 9])
    assert p.held(a) == ctx[:5] + [9, 9]
    c = p.m.admit("c")
    assert p.m.match(c, ctx) == 4
    p.check()


def test_a_hash_collision_is_a_miss(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(PrefixCache, "key", staticmethod(lambda parent, tokens: 1))
    p = _Pool(8)
    a, b = p.m.admit("a"), p.m.admit("b")
    p.write(a, [1, 2, 3, 4])
    p.m.publish(a, [1, 2, 3, 4, 5])
    assert p.m.match(b, [1, 2, 3, 5, 6]) == 0
    assert p.m.match(b, [1, 2, 3, 4, 6]) == 4


def test_without_prefix_caching_nothing_is_shared() -> None:
    p = _Pool(8, prefix_caching=False)
    a, b = p.m.admit("a"), p.m.admit("b")
    p.write(a, list(range(9)))
    p.m.publish(a, list(range(10)))
    assert p.m.match(b, list(range(10))) == 0 and p.m.prefix is None
    p.m.free(a)
    assert p.m.free_blocks == 8


def test_random_operations_keep_every_sequence_reading_its_own_tokens() -> None:
    """Admit with a match, write, publish, roll back, evict, free, under a pool too small for
    everything: every sequence reads back exactly its tokens, and the counts add up."""
    rng = random.Random(5)
    p = _Pool(24, max_seqs=6)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    ctx: dict[int, list[int]] = {}
    for _ in range(3000):
        op = rng.choice(["admit", "write", "write", "rollback", "evict", "free"])
        if op == "admit" and p.m.free_seqs:
            s = p.m.admit("r")
            ctx[s] = rng.choice(stems)[:rng.randint(1, 12)] + [rng.randrange(50)
                                                               for _ in range(rng.randint(1, 6))]
            p.m.match(s, ctx[s])
            assert p.held(s) == ctx[s][:p.m.lengths[s]]
        elif ctx:
            s = rng.choice(sorted(ctx))
            if op == "write":
                new = [rng.randrange(50) for _ in range(rng.randint(1, 5))]
                try:
                    p.write(s, ctx[s][p.m.lengths[s]:] + new)
                except CacheFull:
                    continue
                ctx[s] += new
                p.m.publish(s, ctx[s] + [0])
            elif op == "rollback":
                n = rng.randint(0, p.m.lengths[s])
                p.m.rollback(s, n)
                ctx[s] = ctx[s][:n] + [rng.randrange(50)]
            elif op == "evict":
                p.m.evict(s)
                p.m.match(s, ctx[s])
            else:
                p.m.free(s)
                del ctx[s]
        for s in ctx:
            assert p.held(s) == ctx[s][:p.m.lengths[s]]
        p.check()
    assert p.m.prefix.hits > 0


# ---- through the engine: outputs unchanged ------------------------------------------------------

def _prompts(n: int, shared: int, own: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    system = torch.randint(1, 4000, (shared,), generator=gen).tolist()
    return [system + torch.randint(1, 4000, (own + i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("cache_blocks", [64, 9])
def test_the_verifier_emits_the_targets_tokens_with_prefixes_shared(
        family_dir: Path, target, cache_blocks: int) -> None:
    """Six requests sharing a 40-token system prompt, decoded greedily a step at a time in
    two waves of three; with 9 blocks requests are preempted and recompute from what is
    cached."""
    verifier = Verifier(ModelRunner(family_dir / "target", max_seqs=4, max_model_len=128,
                                    kv_cache_bytes=cache_blocks * TBLOCK))
    prefix = verifier.runner.cache.blocks.prefix
    prompts = _prompts(6, 40, 5)
    want = [greedy_continue(target, torch.tensor([p]), 6)[0].tolist() for p in prompts]
    preempted = 0
    for wave in (prompts[:3], prompts[3:]):
        ids = [f"r{prompts.index(p)}" for p in wave]
        ctx = {rid: list(p) for rid, p in zip(ids, wave)}
        fed = dict.fromkeys(ids, 0)
        while todo := [rid for rid, p in zip(ids, wave) if len(ctx[rid]) < len(p) + 6]:
            out = verifier.verify([VerifyRequest(rid, ctx[rid][fed[rid]:], EMPTY, keep=fed[rid])
                                   for rid in todo])
            for rid, v in zip(todo, out):
                preempted += v is None
                ctx[rid] += v.tokens if v is not None else ()
                fed[rid] = len(ctx[rid])
                if len(ctx[rid]) >= len(prompts[int(rid[1:])]) + 6:
                    verifier.release(rid)  # done: its blocks stay idle, its prompt cached
        for rid, p in zip(ids, wave):
            assert ctx[rid][len(p):len(p) + 6] == want[prompts.index(p)]
    # the first wave's requests arrive together: none finds anything; each of the second's
    # finds the system prompt's two full blocks; a preempted request finds its own blocks
    assert (preempted > 0) == (cache_blocks == 9)
    assert prefix.hits == 3 * 32 if not preempted else prefix.hits > 3 * 32
    blocks = verifier.runner.cache.blocks
    assert blocks.free_blocks == blocks.num_blocks and blocks.free_seqs == 4


def test_a_drafter_drafts_the_same_with_a_prefix_found_in_its_cache(family_dir: Path) -> None:
    def run(prefix_caching: bool) -> tuple[list[TokenTree], int]:
        d = ModelDrafter("draft-code", ModelRunner(family_dir / "draft-code", max_seqs=4,
                                                   kv_cache_bytes=4 << 20,
                                                   prefix_caching=prefix_caching))
        trees = []
        for i, p in enumerate(_prompts(3, 40, 3)):
            trees += d.propose([DraftRequest(f"r{i}", tuple(p), 4, ())])
            d.release(f"r{i}")
        prefix = d.runner.cache.blocks.prefix
        return trees, prefix.hits if prefix else 0

    with_cache, hits = run(True)
    without, _ = run(False)
    assert [t.tokens for t in with_cache] == [t.tokens for t in without]
    assert hits == 2 * 32  # the second and third request find the system prompt's two blocks


def test_a_growing_run_takes_the_next_block_when_only_idle_ones_are_left() -> None:
    """Once every free block is idle, a sequence growing past its last block takes the next
    one (its keys stay one run, read as a view) if that one was released among the older
    half; a recently released block keeps its contents."""
    p = _Pool(8)
    old, new = p.m.admit("old"), p.m.admit("new")
    p.write(old, list(range(16)))  # blocks 0-3
    p.m.publish(old, list(range(17)))
    p.m.free(old)
    p.write(new, list(range(100, 116)))  # blocks 4-7
    p.m.publish(new, list(range(100, 117)))
    p.m.free(new)  # released after old's: the newer half
    assert p.m.free_blocks == 8 and p.m.prefix.idle == 8
    a = p.m.admit("a")
    p.write(a, [7] * 4)  # the least recently released: old's last block, 3
    assert p.m.tables[a] == [3]
    p.write(a, [7] * 4)  # 4 is new's (recent): the next least recent instead, old's 2
    assert p.m.tables[a] == [3, 2]
    b = p.m.admit("b")
    assert p.m.match(b, list(range(100, 117))) == 16  # new's blocks all kept
    p.check()


def test_a_growing_run_stays_contiguous_over_old_idle_blocks() -> None:
    p = _Pool(12)
    s1, s2, s3 = p.m.admit("s1"), p.m.admit("s2"), p.m.admit("s3")
    for s, base in ((s1, 0), (s2, 100), (s3, 200)):  # blocks 0-3, 4-7, 8-11
        p.write(s, list(range(base, base + 16)))
        p.m.publish(s, list(range(base, base + 17)))
    p.m.free(s2)  # released first: the older half
    p.m.free(s3)
    p.write(s1, [9] * 4)  # every free block is idle: s1 grows into 4, an old one
    assert p.m.tables[s1] == [0, 1, 2, 3, 4] and p.m.contiguous(s1) == 0
    a = p.m.admit("a")
    assert p.m.match(a, list(range(200, 217))) == 16  # s3's recent blocks all kept
    p.check()
