"""Our own forward for Llama-architecture checkpoints (Llama, Qwen2, Mistral) over a slot KV cache.

One call scores a *ragged* batch: each item is a request (its cache slot) with any number of new
tokens — a prompt to prefill, one token to decode, or a drafted token tree — laid out as a padded
[B, Lq] block with per-item context lengths. Every new token attends to its request's committed
context and, among the new tokens, to its tree ancestors and itself (a chain is the tree where each
token's parent is the one before). Weights, rotary embedding and config come from the transformers
checkpoint; the arithmetic is a plain re-statement of ``LlamaForCausalLM.forward`` (checked to
1e-4 in fp32 by the tests) with no per-request Python loop inside the model.

The forward writes the new tokens' keys and values at ``lengths[slot] + i`` but does not commit
them: the caller commits what verification accepted (``KVCache.commit`` / ``compact``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from .kv_cache import KVCache
from .quant import Int8Linear, Quantization, linear

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ForwardItem:
    """New tokens of one request to run through the model."""

    slot: int
    """The request's KV cache slot."""
    tokens: tuple[int, ...]
    """Token ids, parents before children."""
    parents: tuple[int, ...] | None = None
    """Tree parent index per token (-1 = follows the context); None = a chain."""


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's weights, with q/k/v and gate/up fused into single matrices."""

    qkv: torch.Tensor | Int8Linear  # [(H + 2 * KVH) * hd, D]
    qkv_bias: torch.Tensor | None   # [(H + 2 * KVH) * hd] (Qwen2) or None (or packed in qkv)
    o: torch.Tensor | Int8Linear    # [D, H * hd]
    gate_up: torch.Tensor | Int8Linear  # [2 * I, D]
    down: torch.Tensor | Int8Linear     # [D, I]
    attn_norm: torch.Tensor        # [D]
    mlp_norm: torch.Tensor         # [D]


class ModelRunner:
    """A loaded model and its KV cache."""

    def __init__(self, path: str | Path, num_slots: int = 16, max_len: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                 quantize: Quantization = "none") -> None:
        """``quantize="int8"``: int8 linear weights (``quant.py``; draft models only, CPU and
        fp32 activations)."""
        if quantize not in ("none", "int8"):
            raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")
        if quantize == "int8" and (torch.device(device).type != "cpu" or dtype != torch.float32):
            raise ValueError("int8 weights need device='cpu' and dtype=float32")
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        cfg = hf.config
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"{path}: model type {cfg.model_type!r} is not supported "
                             f"(expected one of {SUPPORTED})")
        window = getattr(cfg, "sliding_window", None)
        self.max_len = max_len or cfg.max_position_embeddings
        if window and getattr(cfg, "use_sliding_window", True) and window < self.max_len:
            raise ValueError(f"{path}: sliding-window attention ({window}) shorter than the "
                             f"context ({self.max_len}) is not supported")
        self.config = cfg
        self.device = torch.device(device)
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        base = hf.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        self.lm_head: torch.Tensor | Int8Linear = hf.lm_head.weight                 # [V, D]
        self.rotary = base.rotary_emb
        self.layers = [self._layer(layer) for layer in base.layers]
        if quantize == "int8":
            self.lm_head = Int8Linear(self.lm_head)
            self.layers = [_Layer(Int8Linear(w.qkv, w.qkv_bias), None, Int8Linear(w.o),
                                  Int8Linear(w.gate_up), Int8Linear(w.down), w.attn_norm,
                                  w.mlp_norm) for w in self.layers]
        self._iota = torch.arange(self.max_len + 1, device=self.device)  # sliced, never rebuilt
        self.cache = KVCache(len(self.layers), num_slots, self.kv_heads, self.max_len,
                             self.head_dim, dtype, device)

    @staticmethod
    def _layer(layer: torch.nn.Module) -> _Layer:
        a, m = layer.self_attn, layer.mlp
        projs = (a.q_proj, a.k_proj, a.v_proj)
        bias = None
        if any(p.bias is not None for p in projs):
            bias = torch.cat([p.bias if p.bias is not None else p.weight.new_zeros(p.out_features)
                              for p in projs])
        return _Layer(torch.cat([p.weight for p in projs]), bias, a.o_proj.weight,
                      torch.cat([m.gate_proj.weight, m.up_proj.weight]), m.down_proj.weight,
                      layer.input_layernorm.weight, layer.post_attention_layernorm.weight)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return w * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)

    @staticmethod
    def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _layout(self, items: list[ForwardItem]) -> tuple[dict[str, torch.Tensor], int]:
        """Padded index tensors of a ragged batch (shapes in comments)."""
        b = len(items)
        sizes = [len(it.tokens) for it in items]
        lq = max(sizes)
        ctx_list = [self.cache.lengths[it.slot] for it in items]
        lk = max(c + n for c, n in zip(ctx_list, sizes))
        if lk > self.max_len:
            raise ValueError(f"context would exceed {self.max_len} tokens")
        dev, iota = self.device, self._iota
        pad = [lq - n for n in sizes]
        tokens = torch.tensor([list(it.tokens) + [0] * p for it, p in zip(items, pad)],
                              device=dev)                                             # [B, Lq]
        ctx = torch.tensor(ctx_list, device=dev)                                      # [B]
        n = torch.tensor(sizes, device=dev)                                           # [B]
        valid = iota[None, :lq] < n[:, None]                                          # [B, Lq]
        chains = all(it.parents is None for it in items)
        if chains:  # causal mask, depth = index + 1
            depth = iota[None, 1:lq + 1].expand(b, lq)
        else:
            parents = torch.tensor([list(it.parents if it.parents is not None
                                         else range(-1, len(it.tokens) - 1)) + [-1] * p
                                    for it, p in zip(items, pad)], device=dev)        # [B, Lq]
            anc, depth = _ancestors(parents)
        positions = ctx[:, None] + depth - 1                                          # [B, Lq]
        out = {"tokens": tokens, "valid": valid, "positions": positions, "ctx": ctx, "mask": None}
        if lq == 1 and b == 1:  # one new token sees the whole context: no mask needed
            return out, lk
        rel = iota[None, None, :lk] - ctx[:, None, None]                              # [B, 1, Lk]
        if chains:
            tree_part = (rel <= iota[None, :lq, None]) & (rel < n[:, None, None])     # [B, Lq, Lk]
        else:
            in_tree = (rel >= 0) & (rel < n[:, None, None])
            tree_part = anc.gather(2, rel.clamp(0, lq - 1).expand(b, lq, lk)) & in_tree
        mask = (rel < 0) | tree_part
        mask = mask | (~valid[:, :, None] & (iota[:lk] == 0))                         # pad rows
        out["mask"] = mask[:, None]                                                   # [B, 1, Lq, Lk]
        return out, lk

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], last_only: bool = False) -> torch.Tensor:
        """Logits [B, Lq, V] of every new token (rows past an item's length are padding), or with
        ``last_only`` [B, 1, V] of each item's last token (all a chain drafter needs)."""
        lay, lk = self._layout(items)
        b, lq = lay["tokens"].shape
        single = b == 1  # one request: its cache rows are a view, its writes a slice
        slot0, start = items[0].slot, self.cache.lengths[items[0].slot]
        if not single:
            slots = torch.tensor([it.slot for it in items], device=self.device)       # [B]
            write_pos = lay["ctx"][:, None] + self._iota[None, :lq]                   # [B, Lq]
            vb, vi = lay["valid"].nonzero(as_tuple=True)                              # [T], [T]
            w_slot, w_pos = slots[vb], write_pos[vb, vi]                              # [T], [T]
        x = F.embedding(lay["tokens"], self.embed)                                    # [B, Lq, D]
        cos, sin = self.rotary(x, lay["positions"])                                   # [B, Lq, hd]
        cos, sin = cos[:, None], sin[:, None]
        for li, w in enumerate(self.layers):
            h = self._rms(x, w.attn_norm)
            qkv = linear(h, w.qkv, w.qkv_bias).view(b, lq, -1, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=1)     # [B, *, Lq, hd]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            ck, cv = self.cache.k[li], self.cache.v[li]                               # [S, KVH, L, hd]
            if single:
                ck[slot0, :, start:start + lq] = k[0]
                cv[slot0, :, start:start + lq] = v[0]
                keys, values = ck[slot0:slot0 + 1, :, :lk], cv[slot0:slot0 + 1, :, :lk]
            else:
                ck[w_slot, :, w_pos] = k[vb, :, vi]
                cv[w_slot, :, w_pos] = v[vb, :, vi]
                keys, values = ck[slots, :, :lk], cv[slots, :, :lk]                   # [B, KVH, Lk, hd]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=lay["mask"],
                                                  enable_gqa=self.kv_heads != self.heads)
            x = x + linear(attn.transpose(1, 2).reshape(b, lq, -1), w.o)
            gate, up = linear(self._rms(x, w.mlp_norm), w.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w.down)
        if last_only:
            last = torch.tensor([len(it.tokens) - 1 for it in items], device=self.device)
            x = x[torch.arange(b, device=self.device), last][:, None]                 # [B, 1, D]
        return linear(self._rms(x, self.norm), self.lm_head)                          # [B, Lq, V]


def _ancestors(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """parents [B, N] (-1 = root) -> (ancestor-or-self mask [B, N, N] bool, depth [B, N] from 1)."""
    b, n = parents.shape
    idx = torch.arange(n, device=parents.device).expand(b, n)
    anc = torch.eye(n, dtype=torch.bool, device=parents.device).repeat(b, 1, 1)
    depth = torch.ones(b, n, dtype=torch.long, device=parents.device)
    cur = idx.clone()
    for _ in range(n - 1):
        par = torch.where(cur >= 0, parents.gather(1, cur.clamp(min=0)), -1)          # [B, N]
        if bool((par < 0).all()):
            break
        anc.scatter_(2, torch.where(par >= 0, par, idx)[..., None], True)
        depth += (par >= 0).long()
        cur = par
    return anc, depth
