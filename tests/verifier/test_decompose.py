"""Request decomposition: the dynamic program against brute force, padding, the edge cases, and
the verifier splitting its batches by the cost model it has."""

from __future__ import annotations

import itertools
import random

import pytest
from prometheus_client import REGISTRY

from spin.engine.model_runner import RunnerConfig
from spin.timing.cost_model import CostModel
from spin.v1 import token_tree_pb2, verifier_pb2
from spin.verifier.decompose import (DEFAULT_VERIFY, GroupCost, decompose, default_cost_model,
                                     padded_fraction)
from spin.verifier.server import VerifierService
from spin.zoo.specs import FAMILY_DIR


def _cost(sizes, groups, cost: GroupCost) -> float:
    return sum(cost(len(g), max(sizes[i][0] for i in g), max(sizes[i][1] for i in g))
               for g in groups)


def _brute(sizes, cost: GroupCost) -> float:
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
    cost = default_cost_model().predict_padded_verify
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
    free_launch = CostModel(verify=(0.0, *DEFAULT_VERIFY[1:])).predict_padded_verify
    assert len(decompose(sizes, free_launch)) == 3


def test_the_default_cost_is_the_hand_set_forward_cost() -> None:
    """launch 9 ms + 0.1 ms per padded new-token row + 20 ns per padded (row x context) pair:
    the constants the verifier decomposed by before it took a cost model."""
    cost = default_cost_model().predict_padded_verify
    for rows, q, k in ((1, 1, 1), (16, 200, 300), (3, 5, 4096)):
        assert cost(rows, q, k) == pytest.approx(0.009 + 1e-4 * rows * q + 2e-8 * rows * q * k,
                                                 rel=1e-12)


def test_a_fitted_cost_model_decides_the_split() -> None:
    """Where launching a forward costs more than the padding, the long prefill stays in."""
    sizes = [(5, 300)] * 15 + [(200, 200)]
    launch_bound = CostModel(verify=(0.5, 0.0, 1e-6, 0.0, 0.0))
    assert decompose(sizes, launch_bound.predict_padded_verify) == [list(range(16))]
    token_bound = CostModel(verify=(0.001, 1e-4, 1e-4, 1e-7, 1e-8))
    assert len(decompose(sizes, token_bound.predict_padded_verify)) == 2


@pytest.mark.parametrize("model, forwards",
                         [(None, 2), (CostModel(verify=(0.5, 0.0, 1e-6, 0.0, 0.0)), 1)])
def test_the_verifier_splits_its_batches_by_its_cost_model(model: CostModel | None,
                                                           forwards: int) -> None:
    """Four requests verifying 4-token chains beside one prefilling a 200-token prompt: two
    forwards by the default cost, one by a model whose launch outweighs the padding."""
    svc = VerifierService(FAMILY_DIR / "target", RunnerConfig(device="cpu", max_seqs=6,
                                                               kv_cache_memory=32 << 20),
                          cost_model=model)
    ctx = {f"d{i}": list(range(10 + i, 40 + i)) for i in range(4)}
    svc.run_batch(verifier_pb2.VerifyRequest(tasks=[
        verifier_pb2.VerifyTask(request_id=r, context_delta=c) for r, c in ctx.items()]))
    tree = token_tree_pb2.TokenTree(tokens=[5, 6, 7, 8], parents=[-1, 0, 1, 2])
    tasks = [verifier_pb2.VerifyTask(request_id=r, keep=svc.verifier.seqs.held(r), tree=tree)
             for r in ctx]
    tasks.append(verifier_pb2.VerifyTask(request_id="new", context_delta=list(range(40, 240))))
    before = REGISTRY.get_sample_value("spin:verify_forwards_per_batch_sum") or 0.0
    resp = svc.run_batch(verifier_pb2.VerifyRequest(tasks=tasks))
    assert len(resp.results) == 5 and all(r.tokens for r in resp.results)
    assert REGISTRY.get_sample_value("spin:verify_forwards_per_batch_sum") - before == forwards


def test_a_large_batch_prices_few_groups() -> None:
    """64 requests: the search prices O(cuts^2) groups, not O(n^2), and still splits a long
    prefill off and keeps uniform decodes in one forward."""
    calls = []
    cost = default_cost_model().predict_padded_verify

    def counted(rows: int, q: int, k: int) -> float:
        calls.append(rows)
        return cost(rows, q, k)

    rng = random.Random(1)
    sizes = [(rng.choice([1, 2, 4, 5]), rng.randint(50, 900)) for _ in range(63)] + [(300, 300)]
    groups = decompose(sizes, counted)
    assert sorted(itertools.chain(*groups)) == list(range(64))
    assert [63] in groups  # the prefill on its own
    assert len(calls) <= 24 * 25 // 2
    assert _cost(sizes, groups, cost) <= _cost(sizes, [list(range(64))], cost)
    assert decompose([(1, 100 + i) for i in range(64)]) == [list(range(64))]
