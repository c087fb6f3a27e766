"""Verification of a drafted token tree against the target: the lossless acceptance rule.

Rows of the target's output: row 0 is the target's distribution after the last context token
(it scores the tree's first level); row ``i + 1`` the distribution after node i.

Greedy: walk from the root, following the child whose token equals the target's argmax; the first
level without such a child emits the argmax (the correction), a leaf emits the argmax after it
(the bonus token). The output equals target-alone greedy decoding, token for token.

Stochastic (multi-step speculative sampling, SpecInfer; for a chain it is the rule of Leviathan et
al. / Chen et al. as in gpt-fast): at each level, with residual r = p (the target row), try the
children in order; child x drafted from q is accepted with probability min(1, r(x) / q(x)); on
rejection r <- norm(max(0, r - q)). When every child is rejected the level emits a sample of r; a
leaf emits a sample of the target row after it. This keeps the target distribution exactly when the
children of a node are independent draws from q. Tokens chosen deterministically (argmax, top-b,
prompt lookup) are verified as one-hot drafts, q = delta(x): acceptance probability r(x), and a
rejection removes x from r — also exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .tree import TokenTree


@dataclass(frozen=True)
class Verdict:
    """The outcome of verifying one request's tree."""

    accepted: tuple[int, ...]
    """Accepted node indices, from the root down (a path of the tree)."""
    tokens: tuple[int, ...]
    """Emitted tokens: the accepted nodes' tokens, then the correction or bonus token."""

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)


def verify_greedy(tree: TokenTree, target_logits: torch.Tensor) -> Verdict:
    """target_logits: [N + 1, V] (rows as in the module docstring)."""
    argmax = target_logits.argmax(-1).tolist()  # [N + 1]
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        want = argmax[row]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            tokens = tuple(tree.tokens[i] for i in accepted) + (want,)
            return Verdict(tuple(accepted), tokens)
        accepted.append(nxt)
        node, row = nxt, nxt + 1


def verify_stochastic(tree: TokenTree, target_probs: torch.Tensor,
                      generator: torch.Generator) -> Verdict:
    """target_probs: [N + 1, V] processed target distributions (``probs_from_logits``).

    ``tree.draft_probs`` ([N, V], each node's draft distribution) is used when present; otherwise
    every node is a one-hot draft.
    """
    accepted: list[int] = []
    node, row = -1, 0
    while True:
        residual = target_probs[row].clone()  # [V]
        chosen = None
        for child in tree.children(node):
            x = tree.tokens[child]
            q = tree.draft_probs[child] if tree.draft_probs is not None else None
            qx = float(q[x]) if q is not None else 1.0
            ratio = float(residual[x]) / qx if qx > 0 else 0.0
            if float(torch.rand((), generator=generator)) < min(1.0, ratio):
                chosen = child
                break
            if q is None:
                residual[x] = 0.0
            else:
                residual = torch.clamp(residual - q, min=0.0)
            total = float(residual.sum())
            if total <= 0.0:  # only when r == q up to rounding; q then had to be accepted
                residual = target_probs[row].clone()
                total = float(residual.sum())
            residual = residual / total
        if chosen is None:
            token = int(torch.multinomial(residual, 1, generator=generator))
            return Verdict(tuple(accepted), tuple(tree.tokens[i] for i in accepted) + (token,))
        accepted.append(chosen)
        node, row = chosen, chosen + 1
