"""Request decomposition (SPIN): split a verification batch into sub-batches that waste less.

One forward pads every request to the batch's longest new-token count (``q``: tree size + tail,
or a whole prompt for a new request) and attends over the longest context (``k``). A request
prefilling 200 tokens next to fifteen 5-token verifications makes all sixteen pay for 200 rows.
Running it as its own forward costs one more launch but removes the padding.

A group's cost is a callable ``group_cost(rows, max_q, max_k) -> seconds``: the fitted cost
model's verification forward with every request padded to ``max_q`` new tokens and ``max_k``
context (``CostModel.predict_padded_verify``). Without a fitted model, ``default_cost_model``
stands in::

    launch + per_token * |g| * max_q(g) + per_attention * |g| * max_q(g) * max_k(g)

Requests are sorted by (q, k); the best split into contiguous runs of that order is found by a
dynamic program over split points, O(n^2) for n requests (n <= a few hundred).
"""

from __future__ import annotations

from collections.abc import Callable

from ..timing.cost_model import CostModel

GroupCost = Callable[[int, int, int], float]
"""(rows, max_q, max_k) -> seconds of one forward over a group of ``rows`` requests."""

DEFAULT_VERIFY: tuple[float, float, float, float, float] = (0.009, 0.0, 1e-4, 0.0, 2e-8)
"""(c0, c1, c2, c3, c4) of the verification model when none is fitted: a launch of 9 ms (weights
streamed once, kernel launches), 0.1 ms per padded new-token row and 20 ns per padded (row x
context position) pair; the batch and context terms are 0."""


def default_cost_model() -> CostModel:
    """The verification cost a verifier without a fitted model decomposes by
    (``DEFAULT_VERIFY``)."""
    return CostModel(verify=DEFAULT_VERIFY)


def decompose(sizes: list[tuple[int, int]], group_cost: GroupCost | None = None,
              max_groups: int | None = None) -> list[list[int]]:
    """Groups of request indices (each group one forward) minimising the summed ``group_cost``
    (default: ``default_cost_model``'s).

    ``sizes[i]`` = (new tokens q, context length after them k) of request i. Groups come out in
    ascending (q, k) order; ``max_groups`` caps the number of forwards.
    """
    n = len(sizes)
    if n == 0:
        return []
    cost = group_cost or default_cost_model().predict_padded_verify
    order = sorted(range(n), key=lambda i: sizes[i])
    q = [sizes[i][0] for i in order]
    k = [sizes[i][1] for i in order]
    limit = min(max_groups or n, n)
    inf = float("inf")
    # best[g][j]: cheapest split of the first j requests into g groups
    best = [[inf] * (n + 1) for _ in range(limit + 1)]
    cut = [[0] * (n + 1) for _ in range(limit + 1)]
    best[0][0] = 0.0
    for g in range(1, limit + 1):
        for j in range(g, n + 1):
            max_k = 0
            for i in range(j - 1, g - 2, -1):  # last group = order[i:j]; q is sorted: max_q = q[j-1]
                max_k = max(max_k, k[i])
                c = best[g - 1][i] + cost(j - i, q[j - 1], max_k)
                if c < best[g][j]:
                    best[g][j], cut[g][j] = c, i
    g = min(range(1, limit + 1), key=lambda g: best[g][n])
    groups, j = [], n
    while g > 0:
        i = cut[g][j]
        groups.append([order[x] for x in range(i, j)])
        j, g = i, g - 1
    return groups[::-1]


def padded_fraction(sizes: list[tuple[int, int]], groups: list[list[int]]) -> float:
    """Share of the computed new-token rows that are padding."""
    rows = sum(len(g) * max(sizes[i][0] for i in g) for g in groups if g)
    useful = sum(q for q, _ in sizes)
    return 1 - useful / rows if rows else 0.0
