"""Request decomposition (SPIN): split a verification batch into sub-batches that waste less.

One forward pads every request to the batch's longest new-token count (``q``: tree size + tail,
or a whole prompt for a new request) and attends over the longest context (``k``). A request
prefilling 200 tokens next to fifteen 5-token verifications makes all sixteen pay for 200 rows.
Running it as its own forward costs one more launch but removes the padding.

Cost of one forward over a group g (a simple model; its constants come from the cost model):

    launch + per_token * |g| * max_q(g) + per_attention * |g| * max_q(g) * max_k(g)

Requests are sorted by (q, k); the best split into contiguous runs of that order is found by a
dynamic program over split points, O(n^2) for n requests (n <= a few hundred).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ForwardCost:
    """Constants of the per-forward cost model (seconds)."""

    launch: float = 0.009
    """Fixed cost of one forward (weights streamed once, kernel launches)."""
    per_token: float = 1e-4
    """Per padded new-token row."""
    per_attention: float = 2e-8
    """Per padded (row x context position) pair."""

    def group(self, rows: int, max_q: int, max_k: int) -> float:
        return self.launch + self.per_token * rows * max_q + self.per_attention * rows * max_q * max_k


def decompose(sizes: list[tuple[int, int]], cost: ForwardCost = ForwardCost(),
              max_groups: int | None = None) -> list[list[int]]:
    """Groups of request indices (each group one forward) minimising the modelled cost.

    ``sizes[i]`` = (new tokens q, context length after them k) of request i. Groups come out in
    ascending (q, k) order; ``max_groups`` caps the number of forwards.
    """
    n = len(sizes)
    if n == 0:
        return []
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
                c = best[g - 1][i] + cost.group(j - i, q[j - 1], max_k)
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
