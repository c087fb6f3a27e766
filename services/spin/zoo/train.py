"""Train one model of the family from scratch: Llama architecture, AdamW, bf16 autocast.

Deterministic for a given spec, data and device: the seed fixes weight initialisation and the order
of training windows. Runs on CUDA when present, else on every CPU core. Saves a Hugging Face
checkpoint (bf16 safetensors + tokenizer) and ``training.json`` with the loss curves.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from .specs import DOMAINS, FamilySpec, ModelSpec

_EVAL_WINDOWS = 8


def llama_config(spec: ModelSpec, family: FamilySpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
        num_key_value_heads=spec.heads, max_position_embeddings=family.max_position_embeddings,
        rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )


class WindowSampler:
    """Random training windows from human text and target continuations, by domain weight.

    Every array is a 1-D uint16 token stream (documents joined by EOS). A window is ``seq_len + 1``
    tokens: inputs and next-token labels.
    """

    def __init__(self, spec: ModelSpec, data_dir: Path, distill_dir: Path | None) -> None:
        self.spec = spec
        self.rng = np.random.default_rng(spec.seed)
        self.domains = [d for d in spec.mix if spec.mix[d] > 0]
        weights = np.array([spec.mix[d] for d in self.domains], dtype=np.float64)
        self.weights = weights / weights.sum()
        self.human = {d: np.load(data_dir / f"{d}.train.npy", mmap_mode="r") for d in self.domains}
        self.distill: dict[str, np.ndarray] = {}
        if spec.distill > 0:
            if distill_dir is None:
                raise ValueError(f"{spec.name} learns from target continuations: distill_dir needed")
            self.distill = {d: np.load(distill_dir / f"{d}.npy", mmap_mode="r") for d in self.domains}

    def batch(self) -> torch.Tensor:
        """[batch, seq_len + 1] int64 token windows."""
        n = self.spec.seq_len + 1
        rows = []
        for _ in range(self.spec.batch):
            domain = self.domains[self.rng.choice(len(self.domains), p=self.weights)]
            use_distill = self.spec.distill > 0 and self.rng.random() < self.spec.distill
            src = self.distill[domain] if use_distill else self.human[domain]
            start = int(self.rng.integers(0, src.shape[0] - n))
            rows.append(np.asarray(src[start:start + n], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))


def eval_windows(data_dir: Path, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
    """Fixed held-out windows per domain: {domain: [windows, seq_len + 1]}."""
    rng = np.random.default_rng(seed)
    out = {}
    for d in DOMAINS:
        arr = np.load(data_dir / f"{d}.heldout.npy", mmap_mode="r")
        starts = rng.integers(0, arr.shape[0] - seq_len - 1, size=_EVAL_WINDOWS)
        out[d] = torch.from_numpy(np.stack([np.asarray(arr[s:s + seq_len + 1], dtype=np.int64)
                                            for s in starts]))
    return out


def _loss(model: LlamaForCausalLM, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits  # [B, L, V]
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    model.eval()
    out = {}
    with torch.autocast(device.type, dtype=torch.bfloat16):
        for d, w in windows.items():
            out[d] = round(float(_loss(model, w.to(device))), 4)
    model.train()
    return out


def train_model(spec: ModelSpec, family: FamilySpec, tokenizer: PreTrainedTokenizerFast,
                data_dir: Path, distill_dir: Path | None, out_dir: Path,
                device: torch.device | None = None) -> dict:
    """Train ``spec`` and save it to ``out_dir``; return the training record."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(llama_config(spec, family, tokenizer)).to(device)
    model.train()
    sampler = WindowSampler(spec, data_dir, distill_dir)
    windows = eval_windows(data_dir, spec.seq_len, family.seed)
    steps = max(1, spec.tokens // (spec.batch * spec.seq_len))
    warmup = max(1, steps // 20)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    curve: list[dict] = []
    eval_every = max(1, steps // 10)
    started = time.perf_counter()
    bar = tqdm(range(steps), desc=f"train {spec.name}", unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        window = sampler.batch().to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = _loss(model, window)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - started
        if step % eval_every == 0 or step == steps - 1:
            point = {"step": step + 1, "tokens": (step + 1) * spec.batch * spec.seq_len,
                     "train_loss": round(loss.item(), 4), "heldout": evaluate(model, windows, device)}
            curve.append(point)
        bar.set_postfix(loss=f"{loss.item():.3f}",
                        tok_s=f"{(step + 1) * spec.batch * spec.seq_len / elapsed:,.0f}")
    record = {
        "spec": asdict(spec), "steps": steps, "tokens": steps * spec.batch * spec.seq_len,
        "wall_s": round(time.perf_counter() - started, 1), "device": device.type,
        "torch": torch.__version__, "parameters": sum(p.numel() for p in model.parameters()),
        "final_heldout_loss": curve[-1]["heldout"], "curve": curve,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True, max_shard_size="20MB")
    tokenizer.save_pretrained(out_dir)
    (out_dir / "training.json").write_text(json.dumps(record, indent=2))
    return record
