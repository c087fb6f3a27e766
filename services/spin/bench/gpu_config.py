"""What ``spin bench gpu`` runs: parts, shapes, sizes and time budgets (full and ``--quick``).

The full run is sized for one H100 inside ``scripts/gpu-check``'s budget (its header has the
timing plan); ``--quick`` uses tiny shapes and few repetitions (well under a minute on 2 CPU
cores, which is what ``tests/bench/test_gpu.py`` runs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..zoo.specs import FAMILY_DIR
from .gpu_shapes import DRAFTERS, LLAMA3_8B, TINY_DRAFTERS, TINY_TARGET, Shape

PARTS = ("target", "verify", "baselines", "e2e", "services", "drafters")
"""Every part, in the order they run (the first three share the target model). The drafters
run last: on the first H100 run (``benchmarks/gpu/``) the services part did not fit a budget
that the drafters' 48 s had used, and the services are the headline."""
QUICK_PARTS = ("target", "verify", "baselines", "drafters")
"""``--quick`` without ``--parts``: the parts that start no services."""
PART_BUDGETS_S = {"target": 60.0, "verify": 60.0, "baselines": 30.0, "drafters": 45.0,
                  "e2e": 120.0, "services": 75.0}
"""Most seconds each part may take, from its first point on (the whole run's ``budget_s`` caps
them too): a part checks between its points and leaves out what does not fit; a service start
waits at most this. verify's runs on both runners, with the second's build in between."""


def parse_parts(text: str) -> tuple[str, ...]:
    """``target,verify`` -> the parts in run order; ValueError naming unknown ones."""
    names = {p.strip() for p in text.split(",") if p.strip()}
    unknown = sorted(names - set(PARTS))
    if unknown or not names:
        raise ValueError(f"unknown parts {unknown} (choose from {','.join(PARTS)})")
    return tuple(p for p in PARTS if p in names)


@dataclass
class GpuBenchConfig:
    """One ``spin bench gpu`` run."""

    quick: bool = False
    """Tiny shapes, few tokens and repetitions."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on the CPU), float32, bfloat16, float16."""
    parts: tuple[str, ...] | None = None
    """Parts to run (``PARTS``); None: all, or ``QUICK_PARTS`` with ``quick``."""
    budget_s: float = 250.0
    """The whole run's seconds: a part that would start past it is skipped."""
    family_dir: Path = FAMILY_DIR
    """The demo family (baselines, e2e, services)."""
    json_path: Path | None = None
    """Where the report is written, after every part (a run cut short keeps what it measured)."""
    part_budgets_s: dict[str, float] = field(default_factory=lambda: dict(PART_BUDGETS_S))
    """Each part's most seconds."""

    @property
    def selected(self) -> tuple[str, ...]:
        if self.parts is not None:
            return tuple(p for p in PARTS if p in self.parts)
        return QUICK_PARTS if self.quick else PARTS

    @property
    def target_shape(self) -> Shape:
        return TINY_TARGET if self.quick else LLAMA3_8B

    @property
    def drafter_shapes(self) -> tuple[Shape, ...]:
        return TINY_DRAFTERS if self.quick else DRAFTERS

    @property
    def reps(self) -> int:
        """Timed repetitions of each point (after one warm-up)."""
        return 2 if self.quick else 3

    @property
    def decode_context(self) -> int:
        """Prompt tokens before the timed decode steps."""
        return 32 if self.quick else 256

    @property
    def decode_tokens(self) -> int:
        """Decode steps per timed repetition (target and drafters)."""
        return 8 if self.quick else 32

    @property
    def verify_batches(self) -> tuple[int, ...]:
        return (1, 4) if self.quick else (1, 8, 32, 64)

    @property
    def verify_tokens(self) -> tuple[int, ...]:
        """New tokens per request of the chain points (a 16-node tree is measured too)."""
        return (1, 2, 4, 8, 16)

    @property
    def verify_reps(self) -> int:
        return 2 if self.quick else 5

    @property
    def drafter_batches(self) -> tuple[int, ...]:
        return (1, 4) if self.quick else (1, 4, 16, 64)

    @property
    def drafter_context(self) -> int:
        return 16 if self.quick else 128

    @property
    def max_model_len(self) -> int:
        """The runners' longest context (it bounds their key buckets, so the graphs captured)."""
        return 128 if self.quick else 512

    @property
    def kv_cache_memory(self) -> int:
        """The target runner's KV cache (64 requests x (256 + 16) tokens of the 8B shape is
        2.1 GiB in bf16)."""
        return (32 << 20) if self.quick else (3 << 30)

    @property
    def drafter_kv_cache_memory(self) -> int:
        return (16 << 20) if self.quick else (1 << 30)

    @property
    def bandwidth_bytes(self) -> int:
        """Size of the copy that measures device memory bandwidth."""
        return (64 << 20) if self.quick else (2 << 30)

    @property
    def baseline_tokens(self) -> int:
        """Tokens per transformers ``generate`` call on the target shape."""
        return 8 if self.quick else 32

    @property
    def demo_prompts(self) -> int:
        """Held-out code prompts of the demo family's in-process comparison."""
        return 1 if self.quick else 4

    @property
    def demo_tokens(self) -> int:
        return 16 if self.quick else 64

    @property
    def e2e_concurrency(self) -> tuple[int, ...]:
        """Single stream and concurrent requests through ``spin serve``'s processes."""
        return (1, 4) if self.quick else (1, 32)

    @property
    def services_prompts(self) -> int:
        return 1 if self.quick else 4

    @property
    def services_tokens(self) -> int:
        return 16 if self.quick else 128

    @property
    def service_kv_cache_memory(self) -> int:
        """KV cache of each service the e2e and services parts start (the demo family needs
        little; without it a CUDA service takes its share of the whole GPU)."""
        return (64 << 20) if self.quick else (1 << 30)

    def as_dict(self) -> dict:
        return {"quick": self.quick, "device": self.device, "dtype": self.dtype,
                "parts": list(self.selected), "budget_s": self.budget_s,
                "part_budgets_s": self.part_budgets_s, "reps": self.reps,
                "decode_context": self.decode_context, "decode_tokens": self.decode_tokens,
                "verify_batches": list(self.verify_batches),
                "verify_tokens": list(self.verify_tokens), "verify_reps": self.verify_reps,
                "drafter_batches": list(self.drafter_batches),
                "drafter_context": self.drafter_context, "max_model_len": self.max_model_len,
                "baseline_tokens": self.baseline_tokens, "demo_prompts": self.demo_prompts,
                "demo_tokens": self.demo_tokens, "e2e_concurrency": list(self.e2e_concurrency),
                "services_prompts": self.services_prompts,
                "services_tokens": self.services_tokens}
