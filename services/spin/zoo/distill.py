"""Sequence-level distillation data: the target's own greedy continuations of training prompts.

Drafts are rewarded for predicting what the *target* will say, not what a human wrote next; training
them partly on the target's continuations raises greedy acceptance. Prompts come from the training
split only, so the held-out measurements stay honest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from .specs import FamilySpec


@torch.inference_mode()
def greedy_continue(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation of equal-length prompts with a KV cache (no padding, no stopping).

    prompts: [B, P] int64 -> [B, new_tokens] int64.
    """
    cache = DynamicCache()
    logits = model(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1]
    out = torch.empty(prompts.shape[0], new_tokens, dtype=torch.long, device=prompts.device)
    for i in range(new_tokens):
        nxt = logits.argmax(-1)  # [B]
        out[:, i] = nxt
        if i + 1 < new_tokens:
            logits = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True).logits[:, -1]
    return out


def build_distill_data(family: FamilySpec, target: PreTrainedModel, data_dir: Path, out_dir: Path,
                       eos_id: int, batch_size: int | None = None) -> dict[str, int]:
    """Write ``{domain}.npy``: prompt + greedy continuation rows joined by EOS; return token counts."""
    device = next(target.parameters()).device
    batch_size = batch_size or (256 if device.type == "cuda" else 64)
    rng = np.random.default_rng(family.seed + 1)
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = {}
    p = family.distill_prompt_tokens
    for domain, n_prompts in family.distill_prompts.items():
        arr = np.load(data_dir / f"{domain}.train.npy", mmap_mode="r")
        starts = rng.integers(0, arr.shape[0] - p, size=n_prompts)
        prompts = torch.from_numpy(np.stack([np.asarray(arr[s:s + p], dtype=np.int64) for s in starts]))
        rows = []
        for i in tqdm(range(0, n_prompts, batch_size), desc=f"distill {domain}", unit="batch"):
            batch = prompts[i:i + batch_size].to(device)
            cont = greedy_continue(target, batch, family.distill_new_tokens)
            rows.append(torch.cat([batch, cont], dim=1).cpu())
        seqs = torch.cat(rows)  # [n_prompts, P + new]
        eos = torch.full((seqs.shape[0], 1), eos_id, dtype=torch.long)
        flat = torch.cat([seqs, eos], dim=1).flatten().numpy().astype(np.uint16)
        np.save(out_dir / f"{domain}.npy", flat)
        counts[domain] = int(flat.size)
    return counts
