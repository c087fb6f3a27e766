"""The chi-square check of the sampling tests: do counts follow a distribution?"""

from __future__ import annotations

import torch


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of ``counts`` under ``probs`` (same shape), cells expecting fewer than 5 pooled
    into one; a count where ``probs`` is 0 fails at once."""
    expected = probs * counts.sum()
    assert counts[expected == 0].sum() == 0, "a token outside the distribution's support"
    small = (expected > 0) & (expected < 5)
    obs = torch.cat([counts[expected >= 5], counts[small].sum()[None]])
    exp = torch.cat([expected[expected >= 5], expected[small].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))
