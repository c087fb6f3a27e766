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
dynamic program over split points: every point for up to ``MAX_CUTS`` requests, beyond that
the points where q changes and evenly spaced ones (``_cut_points``).
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


MAX_CUTS = 16
"""A batch of more requests than this is split only at the points where the new-token count
changes and at up to this many evenly spaced points of the (q, k) order: the search prices
O(cuts^2) groups instead of O(n^2); its earlier form, O(n^3) with a cap on the forwards that no
caller set, cost the verifier ~4 ms of Python a step at 32 requests (py-spy, 2026-11-27), as
much as a GPU's whole step."""


def decompose(sizes: list[tuple[int, int]], group_cost: GroupCost | None = None
              ) -> list[list[int]]:
    """Groups of request indices (each group one forward) minimising the summed ``group_cost``
    (default: ``default_cost_model``'s) over the splits of the (q, k) order at its cut points
    (every point up to ``MAX_CUTS`` requests: then the optimum).

    ``sizes[i]`` = (new tokens q, context length after them k) of request i. Groups come out in
    ascending (q, k) order.
    """
    n = len(sizes)
    if n == 0:
        return []
    cost = group_cost or default_cost_model().predict_padded_verify
    order = sorted(range(n), key=lambda i: sizes[i])
    q = [sizes[i][0] for i in order]
    k = [sizes[i][1] for i in order]
    cuts = _cut_points(q)
    m = len(cuts) - 1  # segments between cut points

    def price(a: int, b: int) -> float:  # one forward over segments a..b-1; q is sorted
        lo, hi = cuts[a], cuts[b]
        return cost(hi - lo, q[hi - 1], max(k[lo:hi]))

    best, back = [0.0] + [float("inf")] * m, [0] * (m + 1)  # best[b]: the first b segments
    for b in range(1, m + 1):
        for a in range(b):
            c = best[a] + price(a, b)
            if c < best[b]:
                best[b], back[b] = c, a
    bounds, b = [], m
    while b > 0:
        bounds.append((back[b], b))
        b = back[b]
    return [[order[x] for x in range(cuts[a], cuts[b])] for a, b in reversed(bounds)]


def _cut_points(q: list[int]) -> list[int]:
    """Where a sorted batch may be split: every point up to ``MAX_CUTS`` requests; beyond,
    where q changes and at ``MAX_CUTS`` evenly spaced points (0 and n included)."""
    n = len(q)
    if n <= MAX_CUTS:
        return list(range(n + 1))
    points = {0, n} | {i for i in range(1, n) if q[i] != q[i - 1]}
    points |= {round(j * n / MAX_CUTS) for j in range(1, MAX_CUTS)}
    return sorted(points)


def padded_fraction(sizes: list[tuple[int, int]], groups: list[list[int]]) -> float:
    """Share of the computed new-token rows that are padding."""
    rows = sum(len(g) * max(sizes[i][0] for i in g) for g in groups if g)
    useful = sum(q for q, _ in sizes)
    return 1 - useful / rows if rows else 0.0
