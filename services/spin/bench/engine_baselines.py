"""Transformers' own ways to decode faster: the baselines of ``spin bench engine``.

Every baseline is greedy ``generate()`` of the target (fp32, batch 1) with ``min_new_tokens`` equal
to ``max_new_tokens``, so every run generates the same number of tokens:

- ``generate``: the target alone;
- ``prompt lookup``: ``generate(prompt_lookup_num_tokens=N)`` (n-grams of up to 2 tokens matched in
  the context, transformers' default);
- ``assisted``: ``generate(assistant_model=draft)``. transformers reads ``num_assistant_tokens``,
  ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` from the *assistant's*
  ``generation_config`` (given to ``generate()`` they land on the target's config and change
  nothing: checked on transformers 5.24 by counting forwards), so ``HFBaselines`` writes each
  setting there before the call.

Assisted settings (``assist_settings``): a constant number of draft tokens per step with the
confidence stop off (``constant-N``); the heuristic schedule starting at 5 tokens (+2 after a step
that accepted every draft token, -1 otherwise; reset at every call, so runs do not depend on their
order); and the library's defaults (``default``: in transformers 5.x 20 tokens, constant, drafting
stops when the draft's probability falls below 0.4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from transformers import GenerationConfig, PreTrainedModel


@dataclass(frozen=True)
class AssistSetting:
    """How transformers' assisted generation drafts (fields of the assistant's generation config)."""

    name: str
    """Label in the report."""
    num_assistant_tokens: int | None
    """Draft tokens per step (a heuristic schedule's starting value); None: the library's default."""
    schedule: str | None
    """``num_assistant_tokens_schedule``; None: the library's default."""
    confidence_threshold: float | None
    """``assistant_confidence_threshold`` (drafting stops when the draft's probability of its token
    falls below it); 0: off; None: the library's default."""

    def as_dict(self) -> dict:
        """The setting's fields as transformers names them (library defaults filled in)."""
        fields = {"num_assistant_tokens": self.num_assistant_tokens,
                  "num_assistant_tokens_schedule": self.schedule,
                  "assistant_confidence_threshold": self.confidence_threshold}
        defaults = library_assist_defaults()
        return {"name": self.name, **{k: defaults.get(k) if v is None else v
                                      for k, v in fields.items()}}


HEURISTIC = AssistSetting("heuristic", 5, "heuristic_transient", 0.0)
LIBRARY_DEFAULT = AssistSetting("default", None, None, None)


def assist_settings(grid: tuple[int, ...], library: bool) -> list[AssistSetting]:
    """``constant-N`` for each N of ``grid``, then (``library``) the heuristic schedule and the
    library's defaults."""
    out = [AssistSetting(f"constant-{n}", n, "constant", 0.0) for n in grid]
    return out + [HEURISTIC, LIBRARY_DEFAULT] if library else out


def library_assist_defaults() -> dict:
    """The installed transformers' defaults of the assisted-generation fields (empty if it does not
    expose them)."""
    try:
        defaults = GenerationConfig._get_default_generation_params()
    except AttributeError:
        return {}
    keys = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
    return {k: defaults[k] for k in keys if k in defaults}


@dataclass(frozen=True)
class HFMethod:
    """One transformers decoding method."""

    kind: Literal["generate", "lookup", "assisted"]
    """Which baseline."""
    lookup_tokens: int = 0
    """``prompt_lookup_num_tokens`` (``lookup`` only)."""
    draft: str | None = None
    """Assistant model's name (``assisted`` only)."""
    assist: AssistSetting | None = None
    """Assistant setting (``assisted`` only)."""

    @property
    def label(self) -> str:
        if self.kind == "lookup":
            return f"hf prompt lookup N={self.lookup_tokens}"
        if self.kind == "assisted":
            return f"hf assisted {self.draft} {self.assist.name}"
        return "hf generate"


class HFBaselines:
    """Runs transformers' ``generate()`` of one target, alone or with a decoding method."""

    def __init__(self, target: PreTrainedModel, drafts: dict[str, PreTrainedModel], eos: int):
        self.target, self.drafts, self.eos = target, drafts, eos

    @torch.inference_mode()
    def generate(self, method: HFMethod, prompt: tuple[int, ...], new_tokens: int) -> list[int]:
        """The ``new_tokens`` generated token ids (greedy; EOS suppressed until then)."""
        ids = torch.tensor([prompt], device=self.target.device)  # [1, P]
        extra: dict = {}
        if method.kind == "lookup":
            extra["prompt_lookup_num_tokens"] = method.lookup_tokens
        elif method.kind == "assisted":
            assistant = self.drafts[method.draft]
            cfg, s = assistant.generation_config, method.assist
            cfg.num_assistant_tokens = s.num_assistant_tokens
            cfg.num_assistant_tokens_schedule = s.schedule
            cfg.assistant_confidence_threshold = s.confidence_threshold
            extra["assistant_model"] = assistant
        out = self.target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   pad_token_id=self.eos, **extra)  # [1, P + new_tokens]
        return out[0, len(prompt):].tolist()
