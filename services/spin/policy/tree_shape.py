"""Token-tree shapes: how many tokens a tree is expected to get accepted, and what it costs.

A shape is ``branching``: ``branching[d]`` children per node at depth d + 1, 1 past its end (the
engine's ``DraftRequest.shape``); () is a chain. Every node's children are the drafter's top-b
tokens at that node (greedy) or b independent draws (sampling). The verifier walks the tree from
the root and takes, at each level, the first child the target accepts (``engine/rejection.py``).

Acceptance model: a node's rank-1 child is accepted with probability ``alpha`` (the request's
acceptance rate for the drafter, as a chain measures it); when it is not, the rank-2 child is
with probability ``beta`` (how often the target's token is the drafter's second choice when it is
not its first), and each further rank with ``beta`` of what is left. So a node with b children
passes the walk on with probability

    p(b) = alpha + (1 - alpha) * (1 - (1 - beta) ** (b - 1))

and the expected accepted tokens of a shape are, from the leaves up,

    E_k = 0,    E_d = p(b_d) * (1 + E_{d+1}),

(every child at one depth has the same sub-shape). A chain is b = 1 everywhere: E = the familiar
alpha (1 - alpha^k) / (1 - alpha). Trees pay in tokens verified (``nodes + 1`` rows instead of
``k + 1``) and drafted (a tree re-feeds its nodes at each level): ``nodes`` and ``fed``
(``engine/tree.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..engine.tree import Shape, fed, nodes, widths

__all__ = ["Shape", "candidates", "expected_accepted", "fed", "nodes", "pass_rate", "widths"]

def pass_rate(alpha: float, beta: float, children: int) -> float:
    """Probability that the walk goes on past a node with ``children`` ranked children."""
    if children <= 0:
        return 0.0
    return alpha + (1.0 - alpha) * (1.0 - (1.0 - beta) ** (children - 1))


def expected_accepted(alpha: float, beta: float, branching: Shape, k: int) -> float:
    """Expected accepted draft tokens of the shape (the module's recursion)."""
    e = 0.0
    for b in reversed(widths(branching, k)):
        e = pass_rate(alpha, beta, b) * (1.0 + e)
    return e


def candidates(k: int, max_nodes: int, shapes: Sequence[Shape] = ((), (2,), (2, 2), (3,))
               ) -> list[Shape]:
    """The shapes worth weighing at depth ``k``: a chain, and the trees whose nodes stay within
    ``max_nodes`` (branching at the first levels, where it matters most: every accepted token
    passes through them)."""
    out = []
    for s in shapes:
        s = tuple(s[:k])
        if s not in out and nodes(s, k) <= max_nodes:
            out.append(s)
    return out
