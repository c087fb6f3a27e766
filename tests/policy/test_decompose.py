"""Request decomposition: the dynamic program against brute force, padding, and the edge cases."""

from __future__ import annotations

import itertools
import random

from spin.policy.decompose import ForwardCost, decompose, padded_fraction


def _cost(sizes, groups, cost: ForwardCost) -> float:
    return sum(cost.group(len(g), max(sizes[i][0] for i in g), max(sizes[i][1] for i in g))
               for g in groups)


def _brute(sizes, cost: ForwardCost) -> float:
    order = sorted(range(len(sizes)), key=lambda i: sizes[i])
    best = float("inf")
    for mask in range(1 << (len(sizes) - 1)):  # every split of the sorted order
        groups, cur = [], [order[0]]
        for x in range(1, len(order)):
            if mask >> (x - 1) & 1:
                groups.append(cur)
                cur = []
            cur.append(order[x])
        groups.append(cur)
        best = min(best, _cost(sizes, groups, cost))
    return best


def test_matches_brute_force_on_random_batches() -> None:
    rng = random.Random(0)
    cost = ForwardCost()
    for _ in range(60):
        sizes = [(rng.choice([1, 3, 5, 9, 64, 200]), rng.randint(20, 600)) for _ in range(rng.randint(1, 8))]
        groups = decompose(sizes, cost)
        assert sorted(itertools.chain(*groups)) == list(range(len(sizes)))
        assert abs(_cost(sizes, groups, cost) - _brute(sizes, cost)) < 1e-12


def test_a_long_prefill_gets_its_own_forward() -> None:
    sizes = [(5, 300)] * 15 + [(200, 200)]
    groups = decompose(sizes)
    assert [15] in groups and len(groups) == 2
    assert padded_fraction(sizes, groups) == 0.0
    assert padded_fraction(sizes, [list(range(16))]) > 0.9  # 16 x 200 rows for 275 useful


def test_uniform_batches_stay_one_forward_and_limits() -> None:
    assert decompose([(5, 100)] * 32) == [list(range(32))]
    assert decompose([]) == []
    sizes = [(1, 50), (100, 50), (200, 50)]
    assert len(decompose(sizes, max_groups=1)) == 1
    free_launch = ForwardCost(launch=0.0)
    assert len(decompose(sizes, free_launch)) == 3
