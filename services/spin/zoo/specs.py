"""The demo model family: what each model is, how big, and what it is trained on.

One shared byte-level BPE tokenizer; a Llama-architecture target; heterogeneous drafts that differ
in size *and* training mix, so that the best draft depends on the kind of request. Drafts learn
partly from the target's own greedy continuations (sequence-level distillation), which is what
speculative decoding rewards.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

Domain = Literal["code", "prose", "structured"]
DOMAINS: tuple[Domain, ...] = ("code", "prose", "structured")

#: Where the committed family lives (``SPIN_FAMILY_DIR`` points elsewhere, e.g. a rebuilt family).
REPO_ROOT = Path(__file__).resolve().parents[3]
FAMILY_DIR = Path(os.environ.get("SPIN_FAMILY_DIR", REPO_ROOT / "models" / "demo"))
#: The held-out prompt set committed with the family (prompt + the human text that follows it).
HELDOUT_PROMPTS = "heldout_prompts.jsonl"
#: Scratch space for the corpus, token arrays and distillation data (not committed); its parent
#: also holds ``spin serve``'s logs and cost model. ``SPIN_BUILD_DIR`` moves it (in a container:
#: somewhere writable, e.g. /home/spin/.cache/spin).
BUILD_DIR = Path(os.environ.get("SPIN_BUILD_DIR", REPO_ROOT / "build")) / "zoo"


@dataclass(frozen=True)
class ModelSpec:
    """One model of the family and the recipe that trains it."""

    name: str
    """Directory name under the family directory (``models/demo/<name>``)."""
    role: Literal["target", "draft"]
    """The target is verified against; drafts propose tokens."""
    layers: int
    """Number of decoder layers."""
    hidden: int
    """Hidden size (model width)."""
    intermediate: int
    """MLP inner size."""
    heads: int
    """Attention heads (no grouped-query attention at these sizes)."""
    mix: dict[str, float]
    """Domain weights of the training stream, e.g. ``{"code": 1.0}`` for a code specialist."""
    distill: float
    """Fraction of training windows drawn from the target's greedy continuations (same mix)."""
    tokens: int
    """Training tokens (the budget: steps = tokens / (batch * seq_len))."""
    lr: float = 2e-3
    """Peak AdamW learning rate (linear warm-up, cosine decay to a tenth)."""
    batch: int = 16
    """Sequences per optimiser step."""
    seq_len: int = 512
    """Training sequence length."""
    seed: int = 0
    """Seed of weights initialisation and data order."""
    description: str = ""
    """One line for the family README."""


@dataclass(frozen=True)
class FamilySpec:
    """The whole family and the shared settings of its build."""

    models: tuple[ModelSpec, ...]
    """Target first, then the drafts."""
    vocab_size: int = 4096
    """Byte-level BPE vocabulary size (shared by every model)."""
    max_position_embeddings: int = 1024
    """Longest context the models accept."""
    heldout_percent: int = 5
    """Share of documents held out from training, chosen by a hash of the document id."""
    distill_prompts: dict[str, int] = field(
        default_factory=lambda: {"code": 1536, "prose": 1024, "structured": 512})
    """Number of training prompts per domain that the target continues for distillation."""
    distill_prompt_tokens: int = 64
    """Prompt length of a distillation sequence."""
    distill_new_tokens: int = 192
    """Tokens the target generates per distillation prompt (greedy)."""
    seed: int = 1234
    """Seed of corpus sampling, tokenizer sample and distillation prompts."""

    @property
    def target(self) -> ModelSpec:
        return next(m for m in self.models if m.role == "target")

    @property
    def drafts(self) -> tuple[ModelSpec, ...]:
        return tuple(m for m in self.models if m.role == "draft")

    def get(self, name: str) -> ModelSpec:
        for m in self.models:
            if m.name == name:
                return m
        raise KeyError(f"no model named {name!r} in the family: {[m.name for m in self.models]}")


_ALL = {"code": 0.4, "prose": 0.4, "structured": 0.2}

DEMO_FAMILY = FamilySpec(models=(
    ModelSpec("target", "target", layers=8, hidden=384, intermediate=1024, heads=6, mix=_ALL,
              distill=0.0, tokens=6_000_000, lr=1.5e-3, seed=1,
              description="target: Llama 8 x 384, all domains"),
    ModelSpec("draft-structured", "draft", layers=1, hidden=128, intermediate=384, heads=2,
              mix={"structured": 1.0}, distill=0.5, tokens=3_000_000, seed=2,
              description="tiny structured specialist: 1 x 128, structured only, half distilled"),
    ModelSpec("draft-code", "draft", layers=2, hidden=192, intermediate=512, heads=3,
              mix={"code": 1.0}, distill=0.6, tokens=4_000_000, seed=3,
              description="code specialist: 2 x 192, code only, mostly distilled"),
    ModelSpec("draft-prose", "draft", layers=2, hidden=192, intermediate=512, heads=3,
              mix={"prose": 1.0}, distill=0.6, tokens=4_000_000, seed=4,
              description="prose specialist: 2 x 192, prose only, mostly distilled"),
    ModelSpec("draft-general", "draft", layers=4, hidden=256, intermediate=688, heads=4, mix=_ALL,
              distill=0.0, tokens=3_500_000, seed=5,
              description="larger general draft: 4 x 256, all domains, human text only"),
))


def scaled(family: FamilySpec, scale: float) -> FamilySpec:
    """The same family with every token and prompt budget multiplied by ``scale`` (smoke runs)."""
    from dataclasses import replace

    models = tuple(replace(m, tokens=max(m.batch * m.seq_len, int(m.tokens * scale)))
                   for m in family.models)
    prompts = {d: max(8, int(n * scale)) for d, n in family.distill_prompts.items()}
    return replace(family, models=models, distill_prompts=prompts)
