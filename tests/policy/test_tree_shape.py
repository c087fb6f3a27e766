"""Tree shapes: expected accepted tokens under the rank acceptance model, nodes and feeds."""

import random

import pytest

from spin.engine.drafter import DraftRequest
from spin.policy.tree_shape import candidates, expected_accepted, fed, nodes, pass_rate


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.99])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_a_chain_is_the_familiar_geometric_sum(alpha: float, k: int) -> None:
    want = sum(alpha ** j for j in range(1, k + 1))  # = alpha (1 - alpha^k) / (1 - alpha)
    assert expected_accepted(alpha, 0.7, (), k) == pytest.approx(want)


def test_nodes_match_the_engines_tree_size() -> None:
    for branching in [(), (2,), (2, 2), (3,), (2, 1, 2)]:
        for k in range(1, 7):
            assert nodes(branching, k) == DraftRequest("r", (), k, branching).tree_size(k)
    assert fed((), 4) == 3 and fed((2,), 3) == 2 + 4 and fed((2, 2), 3) == 2 + 6


def test_a_second_child_helps_by_beta_of_the_misses() -> None:
    assert pass_rate(0.6, 0.5, 1) == 0.6
    assert pass_rate(0.6, 0.5, 2) == pytest.approx(0.6 + 0.4 * 0.5)
    assert pass_rate(0.6, 0.5, 3) == pytest.approx(0.6 + 0.4 * 0.75)
    chain, tree = expected_accepted(0.6, 0.5, (), 4), expected_accepted(0.6, 0.5, (2,), 4)
    assert tree > chain
    assert expected_accepted(0.6, 0.0, (2, 2), 4) == pytest.approx(chain)  # beta 0: no gain


def test_the_recursion_agrees_with_simulated_walks() -> None:
    """Walk random trees of the shape: at each node the rank-1 child passes with alpha, else
    each next rank with beta; the mean accepted depth matches the closed form."""
    rng = random.Random(0)
    for alpha, beta, shape, k in [(0.7, 0.4, (2,), 4), (0.5, 0.3, (2, 2), 3), (0.9, 0.6, (3,), 5)]:
        total = 0
        for _ in range(40_000):
            depth = 0
            for b in [shape[d] if d < len(shape) else 1 for d in range(k)]:
                if rng.random() < alpha or any(rng.random() < beta for _ in range(b - 1)):
                    depth += 1
                else:
                    break
            total += depth
        assert total / 40_000 == pytest.approx(expected_accepted(alpha, beta, shape, k), rel=0.02)


def test_candidates_stay_within_the_node_budget() -> None:
    assert candidates(4, 4) == [()]
    assert candidates(4, 8) == [(), (2,)]
    assert (2, 2) in candidates(4, 16) and (3,) in candidates(4, 16)
    assert candidates(1, 16) == [(), (2,), (3,)]  # one level: (2, 2) is (2,)
