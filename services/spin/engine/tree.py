"""Token trees: what a drafter proposes for one request in one step.

A tree hangs off the request's last context token. Nodes are listed parents-first; ``parents[i]`` is
the index of node i's parent, or -1 when node i directly follows the context. A chain of k drafted
tokens is the tree with parents ``[-1, 0, 1, ..., k-2]``. Mirrors ``spin.v1.TokenTree``.

A tree's *shape* is ``branching``: children per node per level (1 past its end; () = a chain);
``nodes`` and ``fed`` count what a shape costs to verify and to draft.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


Shape = tuple[int, ...]
"""Children per node per level (past its end: 1)."""


def widths(branching: Shape, k: int) -> list[int]:
    """Children per node at each of the k levels."""
    return [branching[d] if d < len(branching) else 1 for d in range(k)]


def nodes(branching: Shape, k: int) -> int:
    """Nodes of the tree (draft tokens sent for verification)."""
    total, width = 0, 1
    for b in widths(branching, k):
        width *= b
        total += width
    return total


def fed(branching: Shape, k: int) -> int:
    """Tokens a drafter's forwards take in past its context: a chain feeds each new leaf once
    (k - 1); a tree re-feeds all its nodes at each level but the last."""
    if all(b == 1 for b in widths(branching, k)):
        return max(k - 1, 0)
    total, level_nodes = 0, 0
    width = 1
    for b in widths(branching, k)[:-1]:
        width *= b
        level_nodes += width
        total += level_nodes
    return total


def ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] (-1 = root) -> (ancestor-or-self mask [B, N, N] bool, depth [B, N] from 1)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device).expand(b, n)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    depth = torch.ones(b, n, dtype=torch.long, device=parents.device)
    cur = idx.clone()
    for _ in range(n - 1):
        par = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)          # [B, N]
        if bool((par < 0).all()):
            break
        anc.scatter_(2, torch.where(par >= 0, par, idx)[..., None], True)
        depth += (par >= 0).long()
        cur = par
    return anc, depth


@dataclass(frozen=True)
class TokenTree:
    """Drafted tokens of one request and their tree structure."""

    tokens: tuple[int, ...]
    """Drafted token id of each node, parents before children."""
    parents: tuple[int, ...]
    """Parent node index of each node; -1 = follows the last context token."""
    draft_probs: torch.Tensor | None = field(default=None, compare=False)
    """[N, V] draft distribution *at each node's position* (the distribution the node's token was
    drawn from), for stochastic verification; None when the tokens were chosen deterministically
    (argmax, top-b, prompt lookup), in which case verification treats them as one-hot drafts."""
    second: tuple[int, ...] = field(default=(), compare=False)
    """A greedy chain's runner-up: the drafter's second choice at each node's position (empty
    when unknown). When the target rejects a node, whether its token was this one measures how
    much a second branch would have added (``policy/tree_shape.py``)."""

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must precede their children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != len(self.tokens):
            raise ValueError(f"draft_probs has {self.draft_probs.shape[0]} rows for "
                             f"{len(self.tokens)} nodes")
        if self.second and len(self.second) != len(self.tokens):
            raise ValueError(f"{len(self.second)} runner-up tokens for {len(self.tokens)} nodes")

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: torch.Tensor | None = None) -> TokenTree:
        """A linear chain: each token follows the previous one."""
        return cls(tuple(tokens), tuple(range(-1, len(tokens) - 1)), draft_probs)

    def __len__(self) -> int:
        return len(self.tokens)

    def subtree(self, nodes: list[int]) -> TokenTree:
        """The tree of ``nodes`` only (ascending, each one's parent among them or -1), with
        their draft rows and runner-ups."""
        index = {n: i for i, n in enumerate(nodes)}
        parents = tuple(-1 if self.parents[n] < 0 else index[self.parents[n]] for n in nodes)
        probs = self.draft_probs[list(nodes)] if self.draft_probs is not None else None
        second = tuple(self.second[n] for n in nodes) if self.second else ()
        return TokenTree(tuple(self.tokens[n] for n in nodes), parents, probs, second)

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    def depths(self) -> list[int]:
        """Depth of each node (1 for children of the context)."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def children(self, node: int) -> list[int]:
        """Children of ``node`` (-1 = the context), in listing order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: entry (i, j) is True iff node j is node i or one of its ancestors.

        This is the tree-attention mask among drafted tokens; every node also sees the whole context.
        """
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask
