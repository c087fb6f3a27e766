"""Per-request sampling parameters and the logits -> probabilities transform.

Target and draft distributions go through the *same* transform (temperature, then top-k, then
top-p), so the rejection rule keeps the distribution the user asked for: the target's, as processed
by that request's parameters. A request's seed drives its own generator, so a seeded request draws
the same numbers whatever else shares its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request turns target logits into tokens."""

    temperature: float = 0.0
    """0 = greedy (argmax); > 0 divides the logits before softmax."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose mass reaches top_p (1.0 = off)."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    seed: int | None = None
    """Seed of this request's generator (None = nondeterministic)."""

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A fresh generator for this request (seeded when a seed is set)."""
        return seeded_generator(self.seed, device)


def seeded_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded with ``seed``, or from the OS when ``seed`` is None."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k and top-p.

    Greedy parameters give the one-hot distribution of the argmax, so greedy decoding is the
    temperature -> 0 limit of the same rule.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted so that the largest is 0 first: a tiny temperature then sends the others to -inf,
    # never the largest to +inf (inf - inf would make the softmax NaN)
    logits = (logits - logits.amax(-1, keepdim=True)) / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # Drop a token when the mass strictly before it already reaches top_p (the top-1 stays).
        drop_sorted = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
