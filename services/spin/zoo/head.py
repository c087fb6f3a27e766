"""An EAGLE-3 draft head for the demo target: its data, its training and its acceptance.

Data is the target's own output, as EAGLE trains on: prompts from the corpus's *training* split
(committed tokenizer), continued by the target, half greedy and half sampled at temperature 0.8;
one target forward per sequence keeps the head's features (the inputs of the three aux layers)
and the target's last normed states (its distributions, recomputed per batch). The draft
vocabulary is the continuations' most frequent tokens (EAGLE-3's ``d2t``/``t2d``). The loss is
the cross-entropy to the target's distribution restricted to it (KL up to a constant, as
EAGLE-3) over EAGLE-3's training-time test: ``unrolled`` runs drafting steps 0 .. n-1 over whole
sequences, step j's state at p being step j-1's pre-norm output at p-1, its query seeing the
target-feature keys up to p-j and its own chain's keys of steps 1..j, as serving does.

Acceptance follows the target's own continuations of the *tuning* half of the held-out prompts:
there a drafter's chain equals its teacher-forced proposals at each depth while accepted, so
dense forwards give every greedy step exactly and, sampled, the expected accepted tokens from
every point (chained rejection-rule probabilities sum(min(p, q)) at that temperature).
"""

from __future__ import annotations

import copy
import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import DynamicCache, PreTrainedModel

from ..engine.eagle import EagleHead, random_head
from .corpus import heldout_prompts, read_documents
from .specs import DOMAINS

Drafter = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(tokens [T], features [T, 3Dt]) -> logits [k, T, V]; [i, t]: token t + 1, drafted (i + 1)-th."""


@dataclass(frozen=True)
class HeadSpec:
    """What the head stage builds and how."""

    prompts: dict[str, int] = field(
        default_factory=lambda: {"code": 640, "prose": 640, "structured": 320})
    """Training prompts per domain (from the corpus's training split)."""
    prompt_tokens: int = 96
    new_tokens: int = 128
    """Tokens the target adds to each prompt: half greedy, ``sampled_share`` sampled."""
    sampled_share: float = 0.5
    temperature: float = 0.8
    draft_vocab: int = 2048
    """Vd: the most frequent tokens of the continuations."""
    unroll: int = 3
    """Drafting steps of the training-time test (step 0 is the plain forward), step j's loss
    weighted by ``step_weight ** j``."""
    step_weight: float = 0.8
    soft_weight: float = 1.0
    """Loss: soft_weight x cross-entropy to the target's distribution + hard_weight x to its
    argmax (both restricted to the draft vocabulary)."""
    hard_weight: float = 0.0
    batch: int = 8
    lr: float = 1e-3
    budget_s: float = 900.0
    """Wall clock of the training loop (its steps planned from the speed of the first)."""
    val_seqs: int = 8
    """Training sequences kept out of training for the loss curve."""
    seed: int = 7


def default_device() -> torch.device:
    """CUDA when present, else the CPU with every core (unless ``OMP_NUM_THREADS`` says)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(os.cpu_count() or 1)
    return torch.device("cpu")


def training_prompts(corpus_dir: Path, tokenizer, spec: HeadSpec) -> torch.Tensor:
    """[N, P] token prompts from random places (line starts) of training documents."""
    rng = random.Random(spec.seed)
    chars = spec.prompt_tokens * 12
    rows = []
    for domain in DOMAINS:
        docs = [d["text"] for d in read_documents(corpus_dir / f"{domain}.train.jsonl")
                if len(d["text"]) > 2 * chars]
        got = 0
        while got < spec.prompts.get(domain, 0):
            text = rng.choice(docs)
            start = rng.randrange(len(text) - chars)
            start = text.rfind("\n", 0, start) + 1
            ids = tokenizer(text[start:start + chars], add_special_tokens=False)["input_ids"]
            if len(ids) >= spec.prompt_tokens:
                rows.append(ids[:spec.prompt_tokens])
                got += 1
    return torch.tensor(rows, dtype=torch.long)


@torch.inference_mode()
def generate(model: PreTrainedModel, prompts: torch.Tensor, new_tokens: int, temperature: float,
             seed: int, batch: int = 256) -> torch.Tensor:
    """prompts [N, P] -> prompt + continuation [N, P + new]: greedy at temperature 0, else
    sampled (seeded); no stopping at EOS."""
    dev = next(model.parameters()).device
    gen, out = torch.Generator(dev).manual_seed(seed), []
    for i in tqdm(range(0, prompts.shape[0], batch), desc=f"generate t={temperature:g}",
                  unit="batch", disable=prompts.shape[0] <= batch):
        seq = step_in = prompts[i:i + batch].to(dev)
        cache = DynamicCache()
        for _ in range(new_tokens):
            logits = model(input_ids=step_in, past_key_values=cache, use_cache=True).logits[:, -1]
            step_in = (torch.multinomial((logits.float() / temperature).softmax(-1), 1,
                                         generator=gen) if temperature > 0
                       else logits.argmax(-1, keepdim=True))                         # [B, 1]
            seq = torch.cat([seq, step_in], dim=1)
        out.append(seq.cpu())
    return torch.cat(out)


@torch.inference_mode()
def target_features(target: PreTrainedModel, seqs: torch.Tensor, aux: tuple[int, ...],
                    batch: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [N, T] -> (features [N, T, 3 * Dt], last normed states [N, T, Dt]), float16."""
    dev = next(target.parameters()).device
    feats, last = [], []
    for i in range(0, seqs.shape[0], batch):
        hs = target.model(seqs[i:i + batch].to(dev), output_hidden_states=True).hidden_states
        feats.append(torch.cat([hs[a] for a in aux], dim=-1).half().cpu())
        last.append(hs[-1].half().cpu())
    return torch.cat(feats), torch.cat(last)


def build_data(target: PreTrainedModel, prompts: torch.Tensor, spec: HeadSpec,
               aux: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """Continue every prompt (the first ``sampled_share`` of a seeded shuffle sampled) and keep
    tokens [N, T], features [N, T, 3 * Dt], last [N, T, Dt], sampled [N] bool."""
    n = prompts.shape[0]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed))
    sampled = torch.zeros(n, dtype=torch.bool)
    sampled[order[:round(n * spec.sampled_share)]] = True
    seqs = torch.empty(n, spec.prompt_tokens + spec.new_tokens, dtype=torch.long)
    for flag, temp in ((False, 0.0), (True, spec.temperature)):
        rows = sampled == flag
        if rows.any():
            seqs[rows] = generate(target, prompts[rows], spec.new_tokens, temp, spec.seed)
    feats, last = target_features(target, seqs, aux)
    mixed = torch.randperm(n, generator=torch.Generator().manual_seed(spec.seed + 1))
    return {"tokens": seqs[mixed], "features": feats[mixed], "last": last[mixed],
            "sampled": sampled[mixed]}


def draft_vocab(tokens: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent ids of ``tokens`` (ties: the lower id), sorted -> [Vd]."""
    counts = torch.bincount(tokens.flatten(), minlength=vocab_size)
    return torch.argsort(-counts, stable=True)[:size].sort().values


def save_head(head: EagleHead, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """The published format with ``dtype`` weights (``EagleHead.load`` makes them float32)."""
    copy.deepcopy(head).cpu().to(dtype).save(path)


def new_head(target: PreTrainedModel, ids: torch.Tensor, seed: int) -> EagleHead:
    """A head for ``target`` over draft vocabulary ``ids`` [Vd]: random layer, its ``lm_head``
    and final norm started from the target's own rows."""
    head = random_head(target.config, len(ids), seed)
    with torch.no_grad():
        head.d2t.copy_(ids - torch.arange(len(ids)))
        head.t2d.copy_(torch.isin(torch.arange(len(head.t2d)), ids))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[ids])
        head.norm.weight.copy_(target.model.norm.weight)
    return head.train()


def step_mask(t: int, j: int, device: torch.device | None = None) -> torch.Tensor:
    """[T, (j + 1) T] bool: step j's query at p sees step 0's keys up to p - j and step i's key
    at p - j + i (i = 1 .. j)."""
    r = torch.arange(t, device=device)[:, None]
    c = torch.arange(t, device=device)[None]
    return torch.cat([c <= r - j] + [c == r - j + i for i in range(1, j + 1)], dim=1)


def unrolled(head: EagleHead, hidden: torch.Tensor, embeds: torch.Tensor,
             steps: int) -> list[torch.Tensor]:
    """hidden [B, T, D] (fused target features), embeds [B, T, D] (of the tokens one ahead) ->
    the pre-norm outputs [B, T, D] of drafting steps 0 .. steps-1 (step j valid from p = j)."""
    c = head.config
    b, t, _ = hidden.shape
    positions = torch.arange(t, device=hidden.device).expand(b, t)
    keys, values, outs, state = [], [], [], hidden
    for j in range(steps):
        if j:
            state = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))     # p takes step j-1's output at p-1
        q, k, v = head.attention_inputs(embeds, state, positions)                  # [B, T, *, hd]
        keys.append(k)
        values.append(v)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), torch.cat(keys, 1).transpose(1, 2),
            torch.cat(values, 1).transpose(1, 2), attn_mask=step_mask(t, j, hidden.device),
            enable_gqa=c.num_kv_heads != c.num_heads)                              # [B, H, T, hd]
        outs.append(head.after_attention(state, attn.transpose(1, 2).reshape(b, t, -1)))
    return outs


def batch_loss(head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor,
               batch: dict[str, torch.Tensor], spec: HeadSpec) -> tuple[torch.Tensor, list]:
    """Weighted loss of the unrolled steps on a batch (tokens [B, T], features, last) and each
    step's top-1 agreement with the target's argmax over its whole vocabulary."""
    tokens = batch["tokens"]
    hidden = head.fuse(batch["features"][:, :-1].float())                       # [B, T-1, D]
    embeds = F.embedding(tokens[:, 1:], embed)                                  # [B, T-1, D]
    with torch.no_grad(), torch.autocast(hidden.device.type, enabled=False):
        full = batch["last"][:, 1:].float() @ lm_head.T                        # [B, T-1, V]
        want = full.argmax(-1)                                                  # [B, T-1]
        restricted = full[..., head.target_ids]                                 # [B, T-1, Vd]
        probs, best = restricted.softmax(-1), restricted.argmax(-1)
    loss, agree = torch.zeros((), device=hidden.device), []
    for j, out in enumerate(unrolled(head, hidden, embeds, spec.unroll)):
        logp = head.logits(out[:, j:]).float().log_softmax(-1)                  # [B, T-1-j, Vd]
        step = (spec.soft_weight * -(probs[:, j:] * logp).sum(-1).mean()
                + spec.hard_weight * F.nll_loss(logp.flatten(0, 1), best[:, j:].flatten()))
        loss = loss + spec.step_weight ** j * step
        agree.append((head.target_ids[logp.argmax(-1)] == want[:, j:]).float().mean().item())
    return loss, agree


def train_head(head: EagleHead, data: dict[str, torch.Tensor], embed: torch.Tensor,
               lm_head: torch.Tensor, spec: HeadSpec, steps: int | None = None,
               device: torch.device | None = None) -> dict:
    """AdamW (warm-up, cosine decay) on ``data`` within ``spec.budget_s``: ``steps`` when given,
    else planned from the speed of the first ones. Deterministic for a seed and step count."""
    dev = device or default_device()
    head.to(dev).train()
    embed, lm_head = embed.detach().to(dev), lm_head.detach().to(dev)
    n = data["tokens"].shape[0] - spec.val_seqs
    val = {k: v[n:].to(dev) for k, v in data.items()}
    gen = torch.Generator().manual_seed(spec.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    order, total, curve, losses = [], steps, [_validate(head, embed, lm_head, val, spec, 0, [])], []
    bar = tqdm(total=total, desc="head", unit="step")
    started = time.perf_counter()
    step = 0
    while (total is None or step < total) and time.perf_counter() - started < spec.budget_s:
        if len(order) < spec.batch:
            order = torch.randperm(n, generator=gen).tolist()
        rows = torch.tensor([order.pop() for _ in range(spec.batch)])
        for group in opt.param_groups:
            group["lr"] = _lr(spec.lr, step, total or 10 ** 9)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss, _ = batch_loss(head, embed, lm_head,
                                 {k: v[rows].to(dev) for k, v in data.items()}, spec)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        step += 1
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if step == 2:
            mark = time.perf_counter()
        if total is None and step == 12:   # plan from steps 3..12 (the first ones are slower)
            now = time.perf_counter()
            total = bar.total = step + int((spec.budget_s - now + started) / (now - mark) * 9.5)
        if total and (step % max(1, total // 10) == 0 or step == total):
            curve.append(_validate(head, embed, lm_head, val, spec, step, losses))
    bar.close()
    if curve[-1]["step"] != step:
        curve.append(_validate(head, embed, lm_head, val, spec, step, losses))
    return {"steps": step, "planned_steps": total, "device": dev.type, "sequences": n,
            "train_s": round(time.perf_counter() - started, 1),
            "positions": n * (data["tokens"].shape[1] - 1),
            "epochs": round(step * spec.batch / n, 2), "curve": curve}


def _lr(peak: float, step: int, total: int, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to a tenth at ``total``."""
    if step < warmup:
        return peak * (step + 1) / warmup
    done = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * done)))


@torch.no_grad()
def _validate(head: EagleHead, embed: torch.Tensor, lm_head: torch.Tensor,
              val: dict[str, torch.Tensor], spec: HeadSpec, step: int, losses: list) -> dict:
    head.eval()
    with torch.autocast(embed.device.type, dtype=torch.bfloat16):
        loss, agree = batch_loss(head, embed, lm_head, val, spec)
    head.train()
    recent = losses[-50:]
    return {"step": step, "train_loss": round(sum(recent) / len(recent), 4) if recent else None,
            "val_loss": round(loss.item(), 4), "val_top1_by_step": [round(a, 4) for a in agree]}


def head_drafter(head: EagleHead, embed: torch.Tensor, k: int) -> Drafter:
    """The head as a drafter over the target's vocabulary (-inf outside its own)."""
    def draft(tokens: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        hidden = head.fuse(feats[None, :-1].to(head.fc.weight.dtype))            # [1, T-1, D]
        outs = unrolled(head, hidden, F.embedding(tokens[None, 1:], embed), k)
        logits = torch.full((k, tokens.shape[0], head.config.vocab_size), float("-inf"))
        for i, out in enumerate(outs):   # step i at p - 1 predicts token p + 1
            logits[i, 1:, head.target_ids] = head.logits(out[0]).float()
        return logits
    return draft


def model_drafter(model: PreTrainedModel, k: int) -> Drafter:
    """A causal LM as a drafter: along an accepted chain its proposals are teacher-forced."""
    return lambda tokens, feats: model(tokens[None]).logits[0].float().expand(k, -1, -1)


@torch.inference_mode()
def acceptance(target: PreTrainedModel, seqs: list[torch.Tensor], prompt_len: int,
               drafters: dict[str, Drafter], k: int, temperature: float,
               aux: tuple[int, ...]) -> dict[str, list[float]]:
    """Along the target's continuations ``seqs`` (each [T], prompt first): per drafter, the
    accepted draft tokens of each greedy verification step (temperature 0), or the expected
    accepted tokens from every point of the continuation (rejection rule at temperature)."""
    got: dict[str, list[float]] = {name: [] for name in drafters}
    for seq in seqs:
        hs = target.model(seq[None], output_hidden_states=True).hidden_states
        feats = torch.cat([hs[a] for a in aux], dim=-1)[0]                          # [T, 3Dt]
        t_logits = target.lm_head(hs[-1])[0].float()                                # [T, V]
        for name, draft in drafters.items():
            d_logits = draft(seq, feats)                                            # [k, T, V]
            if temperature == 0:
                got[name] += greedy_steps(seq.tolist(), t_logits.argmax(-1).tolist(),
                                          d_logits.argmax(-1).tolist(), prompt_len, k)
            else:
                p = (t_logits / temperature).softmax(-1)                            # [T, V]
                q = (d_logits / temperature).softmax(-1)                            # [k, T, V]
                got[name] += expected_steps(torch.minimum(p, q).sum(-1).tolist(), prompt_len,
                                            seq.shape[0], k)
    return got


def greedy_steps(seq: list[int], t_arg: list[int], proposals: list[list[int]], start: int,
                 k: int) -> list[int]:
    """Accepted draft tokens of each step of a greedy speculative decode of ``seq`` from
    ``start``; ``proposals[i][t]``: the drafter's token t + 1 as the (i + 1)-th of its chain."""
    steps, c = [], start
    while c < len(seq):
        n, a = min(k, len(seq) - c), 0
        while a < n and proposals[a][c - 1 + a] == t_arg[c - 1 + a] == seq[c + a]:
            a += 1
        steps.append(a)
        c += a + 1
    return steps


def expected_steps(alpha: list[list[float]], start: int, length: int, k: int) -> list[float]:
    """Expected accepted draft tokens of a k-chain from every start (``alpha[i][t]``: the
    probability that the chain's (i + 1)-th token, predicting t + 1, is accepted)."""
    return [sum(accumulate((alpha[i][c - 1 + i] for i in range(k)), mul))
            for c in range(start, length - k + 1)]


def tuning_acceptance(target: PreTrainedModel, tokenizer, family_dir: Path,
                      drafters: dict[str, Drafter], aux: tuple[int, ...], k: int = 4,
                      temperature: float = 0.8, prompt_tokens: int = 96, new_tokens: int = 128,
                      seed: int = 0) -> dict:
    """Mean accepted draft tokens per step of each drafter on the target's continuations of the
    tuning half of the held-out prompts, greedy and sampled, per domain and over all."""
    eos = tokenizer.eos_token_id
    result: dict = {"k": k, "temperature": temperature, "prompt_tokens": prompt_tokens,
                    "new_tokens": new_tokens}
    for mode, temp in (("greedy", 0.0), ("sampled", temperature)):
        pooled: dict[str, list[float]] = {name: [] for name in drafters}
        for domain in DOMAINS:
            ids = [tokenizer(r["prompt"], add_special_tokens=False)["input_ids"]
                   for r in heldout_prompts(family_dir, (domain,), split="tuning")]
            prompts = torch.tensor([x[-prompt_tokens:] for x in ids if len(x) >= prompt_tokens])
            seqs = [_until_eos(s, prompt_tokens, eos)
                    for s in generate(target, prompts, new_tokens, temp, seed)]
            got = acceptance(target, seqs, prompt_tokens, drafters, k, temp, aux)
            for name, vals in got.items():
                per = result.setdefault(mode, {}).setdefault(name, {})
                per[domain] = round(sum(vals) / len(vals), 3)
                pooled[name] += vals
            result.setdefault("prompts", {})[domain] = len(seqs)
        for name, vals in pooled.items():
            result[mode][name]["all"] = round(sum(vals) / len(vals), 3)
    return result


def _until_eos(seq: torch.Tensor, prompt_len: int, eos: int) -> torch.Tensor:
    hits = (seq[prompt_len:] == eos).nonzero()
    return seq[:prompt_len + int(hits[0]) + 1] if len(hits) else seq
