"""Workloads: which prompts to send, and when.

Prompts come from the demo family's held-out set (``models/demo/heldout_prompts.jsonl``), so a load
test never scores text the models were trained on. Arrival times follow ``vllm bench serve``: gaps
drawn from a gamma distribution with mean ``1 / rate`` and shape ``burstiness`` (1.0 = Poisson,
smaller = burstier); ``rate = inf`` sends everything at once. The same seed gives the same workload.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from spin.zoo.corpus import PromptSplit, heldout_prompts
from spin.zoo.specs import FAMILY_DIR


@dataclass(frozen=True)
class Request:
    """One request of a workload."""

    index: int
    """Position in the workload (stable across runs with the same seed)."""
    domain: str
    """code, prose or structured."""
    prompt: str
    """Prompt text."""
    arrival_s: float
    """Send time, seconds after the start of the run."""


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Cumulative send times of ``n`` requests (all 0.0 when ``rate`` is infinite)."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0 (got rate={rate}, burstiness={burstiness})")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)  # gamma mean = shape * scale = 1 / rate
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, scale)
    return out


def build_workload(num_prompts: int, rate: float = math.inf, burstiness: float = 1.0,
                   seed: int = 0, family_dir: Path = FAMILY_DIR,
                   domains: tuple[str, ...] | None = None,
                   rows: list[dict[str, str]] | None = None,
                   split: PromptSplit | None = None) -> list[Request]:
    """A seeded mixed workload: prompts shuffled across domains, cycled if more are asked for.
    ``rows`` (``{"domain", "prompt"}``, e.g. ``datasets.read_prompts``) instead of the family's
    held-out prompts; ``split``: only that half of them (``spin.zoo.corpus.prompt_split``; of
    ``rows``, those whose ``split`` names it or who have none)."""
    if rows is None:
        rows = heldout_prompts(family_dir, domains, split)
    elif split is not None:
        rows = [r for r in rows if r.get("split", split) == split]
        if not rows:
            raise ValueError(f"no prompts of the {split} split")
    rng = random.Random(seed)
    order = list(range(len(rows)))
    rng.shuffle(order)
    times = arrival_times(num_prompts, rate, burstiness, seed)
    return [Request(i, rows[order[i % len(rows)]]["domain"], rows[order[i % len(rows)]]["prompt"],
                    times[i]) for i in range(num_prompts)]
