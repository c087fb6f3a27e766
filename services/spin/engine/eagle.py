"""EAGLE-3 draft heads: one decoder layer fed with the target model's own hidden states.

A head (Li et al., EAGLE-3) predicts the target's next tokens from the target's features: at each
position p it takes the fused hidden states of three target layers (low, middle, high: the
residual stream entering each, ``aux_layers``) at p, and the embedding of the token at p + 1, and
predicts the token at p + 2. Drafting further, it feeds its own output (the pre-norm hidden state)
in place of the target's features. Its one layer attends to its own keys and values of the
positions before.

The published checkpoint format loads as it is (vLLM's and SGLang's ``LlamaForCausalLMEagle3``):
``config.json`` (a Llama config with ``draft_vocab_size`` and, optionally, ``target_hidden_size``
and ``eagle_config.eagle_aux_hidden_state_layer_ids``) and safetensors with

- ``fc.weight`` [D, 3 * Dt]: the three target layers' states, fused;
- ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`` [D];
- ``midlayer.self_attn.{q,k,v}_proj.weight`` [*, 2 * D] (input: the normed embedding and the
  normed hidden state, concatenated), ``o_proj.weight`` [D, H * hd];
- ``midlayer.mlp.{gate,up,down}_proj.weight``; ``norm.weight`` [D];
- ``lm_head.weight`` [Vd, D] over the *draft vocabulary*, with ``d2t`` [Vd] (draft id i is target
  id i + d2t[i]) and ``t2d`` [V] bool (target ids in the draft vocabulary);
- ``embed_tokens.weight`` [V, D] optionally (without it, the target's embedding is used).

This module is the head's weights and its dense forward (training, and the reference the paged
serving forward in ``head_runner.py`` is tested against).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"
"""``architectures[0]`` of an EAGLE-3 head's config."""


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input states a head fuses when its config names none (EAGLE-3's
    and vLLM's choice: the third, the middle and the third from last)."""
    return (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))


@dataclass(frozen=True)
class HeadConfig:
    """An EAGLE-3 head's shape (the fields of its ``config.json`` that matter here)."""

    hidden_size: int
    """D: the head's width."""
    num_heads: int
    """Attention heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer)."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """MLP width."""
    vocab_size: int
    """V: the target's vocabulary (the rows of ``t2d``)."""
    draft_vocab_size: int
    """Vd: the head's output vocabulary (rows of ``lm_head``)."""
    target_hidden_size: int
    """Dt: the target's width (``fc`` takes 3 * Dt)."""
    aux_layers: tuple[int, ...]
    """Target layers whose input states are fused (three)."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    rope: dict | None = None
    """Rotary settings passed to transformers' ``LlamaConfig`` (rope_theta, rope_scaling,
    max_position_embeddings)."""

    @classmethod
    def from_dict(cls, cfg: dict, target_layers: int) -> HeadConfig:
        """From a head's ``config.json`` (``target_layers``: the target's layer count, for the
        default fused layers)."""
        d = cfg["hidden_size"]
        heads = cfg["num_attention_heads"]
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids") or default_aux_layers(target_layers)
        if len(aux) != 3 or not all(0 <= a < target_layers for a in aux):
            raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(aux)}: need three layers "
                             f"of the target's {target_layers}")
        rope = {k: cfg[k] for k in ("rope_theta", "rope_scaling", "max_position_embeddings",
                                    "rope_parameters") if cfg.get(k) is not None}
        return cls(d, heads, cfg.get("num_key_value_heads", heads),
                   cfg.get("head_dim") or d // heads, cfg["intermediate_size"],
                   cfg["vocab_size"], cfg.get("draft_vocab_size") or cfg["vocab_size"],
                   cfg.get("target_hidden_size") or d, tuple(aux), cfg.get("rms_norm_eps", 1e-6),
                   rope)

    def to_dict(self) -> dict:
        """The ``config.json`` of this head (the published format)."""
        return {"architectures": [ARCHITECTURE], "model_type": "llama",
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "num_hidden_layers": 1,
                "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
                "hidden_act": "silu", "tie_word_embeddings": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                 "use_aux_hidden_state": True},
                **(self.rope or {})}

    def llama_config(self) -> LlamaConfig:
        """A transformers config with this head's attention shape (its rotary embedding)."""
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           vocab_size=self.vocab_size, rms_norm_eps=self.rms_norm_eps,
                           **(self.rope or {}))


class _Attention(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)


class _MLP(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)


class _Norm(nn.Module):
    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class _MidLayer(nn.Module):
    def __init__(self, c: HeadConfig) -> None:
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.mlp = _MLP(c)


class EagleHead(nn.Module):
    """An EAGLE-3 head's weights (parameter names as the published checkpoints')."""

    def __init__(self, config: HeadConfig) -> None:
        super().__init__()
        c = self.config = config
        self.fc = nn.Linear(3 * c.target_hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(c.vocab_size, dtype=torch.bool)
                             if c.draft_vocab_size == c.vocab_size
                             else torch.zeros(c.vocab_size, dtype=torch.bool))
        self.embed_tokens: nn.Embedding | None = None
        """Its own embedding, when the checkpoint has one (else the target's is used)."""
        self.rotary = LlamaRotaryEmbedding(c.llama_config())

    # ---- format ------------------------------------------------------------------------------
    @classmethod
    def load(cls, path: str | Path, target_layers: int) -> EagleHead:
        """A head from its checkpoint directory (``config.json`` and ``*.safetensors``)."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: no config.json (an EAGLE-3 head's directory)")
        cfg = json.loads((path / "config.json").read_text())
        head = cls(HeadConfig.from_dict(cfg, target_layers))
        state: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            state.update(load_file(str(f)))
        if not state:
            raise ValueError(f"{path}: no *.safetensors weights")
        head.load_weights(state, str(path))
        return head.eval()

    def load_weights(self, state: dict[str, torch.Tensor], where: str = "head") -> None:
        """Weights from a checkpoint's tensors (the published names; ``model.`` prefixes and
        ``layers.0.`` for ``midlayer.`` are accepted too)."""
        norm = {}
        for name, t in state.items():
            name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
            norm[name] = t
        if "embed_tokens.weight" in norm:
            emb = norm.pop("embed_tokens.weight")
            self.embed_tokens = nn.Embedding(*emb.shape)
            self.embed_tokens.weight.data.copy_(emb)
        d2t = norm.pop("d2t", None)
        t2d = norm.pop("t2d", None)
        missing, unexpected = self.load_state_dict(norm, strict=False)
        missing = [m for m in missing if m not in ("d2t", "t2d")]
        if missing or unexpected:
            raise ValueError(f"{where}: not an EAGLE-3 head: missing {missing}, "
                             f"unexpected {unexpected}")
        if d2t is not None:
            self.d2t.copy_(d2t.long())
        if t2d is not None:
            self.t2d.copy_(t2d.bool())
        ids = torch.arange(self.config.draft_vocab_size) + self.d2t
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise ValueError(f"{where}: d2t maps draft ids outside the target's "
                             f"{self.config.vocab_size} tokens")

    def save(self, path: str | Path) -> None:
        """Write the head in the published format."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("rotary.")}
        if self.embed_tokens is not None:
            state["embed_tokens.weight"] = self.embed_tokens.weight.detach().contiguous()
        save_file(state, str(path / "model.safetensors"))
        os.chmod(path / "model.safetensors", 0o644)  # safetensors writes it owner-only

    @property
    def target_ids(self) -> torch.Tensor:
        """[Vd] the target id of each draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    # ---- arithmetic --------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's three layers' states [..., 3 * Dt] -> the head's input state [..., D]."""
        return self.fc(features)

    def qkv_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """embeds [..., D] (the next tokens'), hidden [..., D] -> q/k/v input [..., 2 * D]."""
        m = self.midlayer
        return torch.cat([m.input_layernorm(embeds), m.hidden_norm(hidden)], dim=-1)

    def attention_inputs(self, embeds: torch.Tensor, hidden: torch.Tensor,
                         positions: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """embeds, hidden [B, L, D], positions [B, L] -> q [B, L, H, hd] and k, v
        [B, L, KVH, hd], the rotary embedding applied to q and k."""
        c, a = self.config, self.midlayer.self_attn
        b, n = positions.shape
        x = self.qkv_input(embeds, hidden)                                          # [B, L, 2D]
        cos, sin = self.rotary(x, positions)                                        # [B, L, hd]
        cos, sin = cos[:, :, None], sin[:, :, None]
        return (rope(a.q_proj(x).view(b, n, c.num_heads, c.head_dim), cos, sin),
                rope(a.k_proj(x).view(b, n, c.num_kv_heads, c.head_dim), cos, sin),
                a.v_proj(x).view(b, n, c.num_kv_heads, c.head_dim))

    def after_attention(self, hidden: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after attention output attn [..., H * hd] and the MLP ->
        pre-norm output [..., D] (what the next drafting position takes as its state)."""
        m = self.midlayer
        x = hidden + m.self_attn.o_proj(attn)
        h = m.post_attention_layernorm(x)
        return x + m.mlp.down_proj(F.silu(m.mlp.gate_proj(h)) * m.mlp.up_proj(h))

    def logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """[..., D] -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(prenorm))

    def dense(self, hidden: torch.Tensor, embeds: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
        """Causal forward over whole sequences (training; the reference of the paged forward):
        hidden [B, T, D] (fused target states, or the head's own), embeds [B, T, D] of the
        tokens one position ahead -> pre-norm outputs [B, T, D]."""
        c = self.config
        b, t, _ = hidden.shape
        if positions is None:
            positions = torch.arange(t, device=hidden.device).expand(b, t)
        q, k, v = self.attention_inputs(embeds, hidden, positions)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True,
                                             enable_gqa=c.num_kv_heads != c.num_heads)
        return self.after_attention(hidden, out.transpose(1, 2).reshape(b, t, -1))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of x [..., hd] (cos/sin broadcast to it)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rope_of(config: object) -> dict:
    """A transformers config's rotary settings (its own keys: older ``rope_theta``, newer
    ``rope_parameters``) and its longest position."""
    out = {k: getattr(config, k) for k in ("rope_parameters", "rope_theta", "rope_scaling",
                                           "max_position_embeddings")
           if getattr(config, k, None) is not None}
    if out.get("rope_scaling") == out.get("rope_parameters"):  # transformers' alias of it
        out.pop("rope_scaling", None)
    return out


def random_head(target_config: object, draft_vocab_size: int | None = None,
                seed: int = 0, aux_layers: tuple[int, ...] | None = None) -> EagleHead:
    """A randomly initialised head in the published format for a transformers target config
    (tests): the target's width and attention shape, a draft vocabulary of the target's first
    ``draft_vocab_size`` ids (all by default) mapped through a shuffled ``d2t``."""
    tc = target_config
    v = tc.vocab_size
    vd = draft_vocab_size or v
    heads = tc.num_attention_heads
    cfg = HeadConfig(tc.hidden_size, heads, getattr(tc, "num_key_value_heads", heads),
                     getattr(tc, "head_dim", None) or tc.hidden_size // heads,
                     tc.intermediate_size, v, vd, tc.hidden_size,
                     aux_layers or default_aux_layers(tc.num_hidden_layers), tc.rms_norm_eps,
                     _rope_of(tc))
    g = torch.Generator().manual_seed(seed)
    head = EagleHead(cfg)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
        ids = torch.randperm(v, generator=g)[:vd].sort().values
        head.d2t.copy_(ids - torch.arange(vd))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head.eval()
