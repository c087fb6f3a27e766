import random

import pytest
import torch

from spin.engine.kv_cache import CacheFull, KVCache


def make(slots: int = 3, max_len: int = 8) -> KVCache:
    return KVCache(num_layers=2, num_slots=slots, kv_heads=1, max_len=max_len, head_dim=2)


def test_admit_until_full_then_free() -> None:
    c = make()
    slots = [c.admit(f"r{i}") for i in range(3)]
    assert sorted(slots) == [0, 1, 2] and c.free_slots == 0
    with pytest.raises(CacheFull, match="3 cache slots"):
        c.admit("r3")
    c.free(slots[1])
    assert c.admit("r4") == slots[1] and c.owner(slots[1]) == "r4"
    with pytest.raises(KeyError):
        c.free(99)


def test_commit_rollback_bounds() -> None:
    c = make()
    s = c.admit("a")
    c.commit(s, 5)
    c.rollback(s, 2)
    assert c.lengths[s] == 2
    with pytest.raises(ValueError, match="holds 2"):
        c.rollback(s, 3)
    with pytest.raises(ValueError):
        c.commit(s, 9)


def test_compact_moves_entries_of_every_layer() -> None:
    c = make()
    s = c.admit("a")
    c.k[:, s, 0, :, 0] = torch.arange(8.0)
    c.v[:, s, 0, :, 0] = -torch.arange(8.0)
    c.compact(s, [4, 6], start=3)
    assert c.k[1, s, 0, 3:5, 0].tolist() == [4.0, 6.0]
    assert c.v[0, s, 0, 3:5, 0].tolist() == [-4.0, -6.0]


def test_random_operations_leak_no_slot() -> None:
    rng = random.Random(0)
    c = make(slots=4, max_len=64)
    live: dict[str, int] = {}
    for step in range(1000):
        op = rng.choice(["admit", "extend", "rollback", "free"])
        if op == "admit":
            if c.free_slots:
                live[f"r{step}"] = c.admit(f"r{step}")
            else:
                with pytest.raises(CacheFull):
                    c.admit("x")
        elif live:
            rid = rng.choice(sorted(live))
            slot = live[rid]
            if op == "extend":
                c.commit(slot, min(64, c.lengths[slot] + rng.randint(1, 5)))
            elif op == "rollback":
                c.rollback(slot, rng.randint(0, c.lengths[slot]))
            else:
                c.free(live.pop(rid))
        assert c.free_slots + len(live) == 4
        assert sorted(live.values()) == sorted(s for s in range(4) if c.owner(s) is not None)
    for slot in list(live.values()):
        c.free(slot)
    assert c.free_slots == 4
