"""Synergy's batch-size -> k table from a cost model (``policy/k_table.py``)."""

from __future__ import annotations

from spin.policy.base import PROMPT_LOOKUP
from spin.policy.k_table import k_table
from spin.timing.cost_model import CostModel


def test_k_table_shrinks_with_batch_when_verify_grows_with_scored_tokens() -> None:
    # Verify: fixed 10 ms (memory-bound weights) + 0.1 ms per scored token (compute).
    m = CostModel(verify=(1e-2, 0.0, 1e-4, 0.0, 0.0), draft={"small": (2e-4, 2e-4, 0.0, 0.0)})
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    table = k_table(m, {"small": 0.8}, sizes, k_max=8, context=500)
    ks = [table[b] for b in sizes]
    assert all(x >= y for x, y in zip(ks, ks[1:])), table
    assert table[1] >= 5 and table[256] <= 1 and table[1] > table[64]


def test_k_table_flat_verify_keeps_long_speculation() -> None:
    m = CostModel(verify=(1e-2, 0.0, 0.0, 0.0, 0.0), draft={"small": (0.0, 1e-5, 0.0, 0.0)})
    table = k_table(m, {"small": 0.9, PROMPT_LOOKUP: 0.9}, [1, 64], k_max=6, context=100)
    assert table == {1: 6, 64: 6}


def test_k_table_low_acceptance_and_margin() -> None:
    m = CostModel(verify=(1e-2, 0.0, 1e-4, 0.0, 0.0), draft={"small": (2e-4, 2e-4, 0.0, 0.0)})
    assert k_table(m, {"small": 0.02}, [1, 8], k_max=8, context=100) == {1: 0, 8: 0}
    assert k_table(m, {}, [1], k_max=8, context=100) == {1: 0}
    loose = k_table(m, {"small": 0.3}, [1], k_max=8, context=100)
    strict = k_table(m, {"small": 0.3}, [1], k_max=8, context=100, margin=10.0)
    assert loose[1] > 0 and strict[1] == 0
