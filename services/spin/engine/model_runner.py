"""Our own forward for Llama-architecture checkpoints (Llama, Qwen2, Mistral) over a paged KV cache.

One call scores a *ragged* batch: each item is a request (its cache sequence) with any number of
new tokens — a prompt to prefill, one token to decode, or a drafted token tree — laid out as a
padded [B, Lq] block with per-item context lengths. Every new token attends to its request's
committed context and, among the new tokens, to its tree ancestors and itself (a chain is the tree
where each token's parent is the one before). Weights, rotary embedding and config come from the
transformers checkpoint; the arithmetic is a plain re-statement of ``LlamaForCausalLM.forward``
(checked to 1e-4 in fp32 by the tests) with no per-request Python loop inside the model.

The forward takes the blocks its new tokens need (``KVCache.reserve``: ``CacheFull`` before any
work when too few are free), writes their keys and values at ``lengths[seq] + i`` but does not
commit them: the caller commits what verification accepted (``KVCache.commit`` / ``compact``).

Device and dtype: every tensor lives on the runner's device; index tensors are built on the host
and copied over once per forward, and nothing in the forward reads a device value back (the
caller copies its results to the host once per batch step).

Attention over the paged cache is SDPA over the gathered blocks (a view when a request's blocks
are one run): on the CPU it beats FlexAttention, compiled or not (``spin bench attention``; the
numbers are in the README's section on devices and memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from .attention import AttentionMode, Iota, ragged_layout, sdpa
from .flex_attention import FlexPlan, build_plan, paged_tree_attention
from .kv_cache import BLOCK_SIZE, CacheFull, KVCache, Paged
from .memory import ModelShape, format_size, kv_budget, resolve_device, resolve_dtype
from .quant import Int8Linear, Quantization, linear
from .quant import resolve as resolve_quantization
from .step_graphs import GraphConfig, StepGraphs, iter_rows, static_mask, static_paged
from .step_graphs import describe as describe_graphs
from .transfer import to_device

SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ForwardItem:
    """New tokens of one request to run through the model."""

    seq: int
    """The request's KV cache sequence."""
    tokens: tuple[int, ...] | list[int]
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


@dataclass
class RunnerConfig:
    """How a service loads its model and sizes its KV cache (the model flags of ``spin
    verifier``, ``spin drafter`` and ``spin serve``)."""

    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N."""
    dtype: str = "auto"
    """auto (float32 on the CPU, the checkpoint's dtype on CUDA), float32, bfloat16, float16."""
    kv_cache_memory: int | None = None
    """KV cache budget in bytes; None: ``memory.CPU_KV_CACHE_DEFAULT`` on the CPU, the share
    ``gpu_memory_utilization`` of the GPU less weights and activations on CUDA."""
    gpu_memory_utilization: float = 0.9
    """Share of the GPU's memory this process may use (CUDA, without ``kv_cache_memory``)."""
    max_model_len: int | None = None
    """Longest request (prompt + output); None: the model's context, or what the cache holds."""
    max_seqs: int = 64
    """Requests held at once (their contexts and block tables; not a memory reservation)."""
    block_size: int = BLOCK_SIZE
    """Tokens per KV cache block."""
    quantize: Quantization = "none"
    """int8: int8 linear weights (draft models on the CPU, ``quant.py``)."""
    cuda_graphs: bool = True
    """On CUDA, decode and verification steps replay captured graphs per shape bucket
    (``step_graphs.py``); ignored on the CPU."""
    compile: bool = False
    """``torch.compile`` the bucketed steps (inductor; on the CPU this turns bucketing on)."""
    attention: AttentionMode = "sdpa"
    """sdpa (gathered keys, dense mask) or flex (FlexAttention over the paged pool:
    ``attention.py``)."""
    prefix_caching: bool = True
    """Full context blocks shared across requests and kept after them (``prefix_cache.py``)."""

    def load(self, path: str | Path | PreTrainedModel, vocab_limit: int | None = None
             ) -> ModelRunner:
        """The runner of a checkpoint directory (or cached hub name), or of a model already
        built (e.g. randomly initialised, on its device and dtype)."""
        return ModelRunner(path, self.max_seqs, self.max_model_len, self.device, self.dtype,
                           self.kv_cache_memory, self.gpu_memory_utilization, self.block_size,
                           self.quantize, vocab_limit, self.cuda_graphs, self.compile,
                           self.attention, self.prefix_caching)


class ModelRunner:
    """A loaded model and its KV cache."""

    def __init__(self, path: str | Path, max_seqs: int = 64, max_model_len: int | None = None,
                 device: torch.device | str = "cpu", dtype: torch.dtype | str = "auto",
                 kv_cache_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 block_size: int = BLOCK_SIZE, quantize: Quantization = "none",
                 vocab_limit: int | None = None, cuda_graphs: bool = True,
                 compile: bool = False, attention: AttentionMode = "sdpa",
                 prefix_caching: bool = True) -> None:
        """``device``/``dtype``: as ``memory.resolve_device``/``resolve_dtype`` take them.
        ``kv_cache_bytes``/``gpu_memory_utilization``/``max_model_len``: the cache's budget and
        the longest request (``memory.kv_budget``). ``quantize="int8"``: int8 linear weights
        (``quant.py``; draft models only, CPU and fp32 activations). ``vocab_limit``: score only
        token ids below it (a drafter whose embedding is padded past the tokenizer's tokens,
        or past the target's rows, never drafts an id the target cannot score).
        ``cuda_graphs``/``compile``/``attention``/``prefix_caching``: ``RunnerConfig``'s."""
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention must be 'sdpa' or 'flex', got {attention!r}")
        self.attention = attention
        if quantize not in ("none", "int8"):  # 'auto' is resolved before: ``quant.resolve``
            raise ValueError(f"quantize must be 'none' or 'int8', got {quantize!r}")
        self.device = resolve_device(device) if isinstance(device, str) else torch.device(device)
        hf = path if isinstance(path, PreTrainedModel) else None
        cfg = hf.config if hf is not None else AutoConfig.from_pretrained(path)
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"{path}: model type {cfg.model_type!r} is not supported "
                             f"(expected one of {SUPPORTED})")
        if isinstance(dtype, str):
            dtype = resolve_dtype(dtype, self.device, getattr(cfg, "dtype", None))
        self.dtype = dtype
        if quantize == "int8":
            resolve_quantization("int8", self.device, dtype)  # ValueError where it cannot run
        if hf is None:
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(self.device).eval()
        path = getattr(cfg, "name_or_path", None) or cfg.model_type
        self.config = cfg = hf.config
        shape = ModelShape.of(cfg)
        self._take_weights(hf, vocab_limit, quantize)
        budget = kv_budget(shape, dtype, self.device, block_size, kv_cache_bytes,
                           self.weight_bytes, gpu_memory_utilization=gpu_memory_utilization,
                           max_model_len=max_model_len)
        window = getattr(cfg, "sliding_window", None)
        if window and getattr(cfg, "use_sliding_window", True) and window < budget.max_model_len:
            raise ValueError(f"{path}: sliding-window attention ({window}) shorter than the "
                             f"context ({budget.max_model_len}) is not supported; pass "
                             f"--max-model-len {window} or less")
        self.max_len = budget.max_model_len
        """Longest context (prompt + generated tokens) of one request."""
        self.batch_invariant = self.device.type == "cpu" and dtype in (torch.bfloat16,
                                                                       torch.float16)
        """Half precision on the CPU: every request's output independent of its batch, as a
        request decoding alone would compute it. oneDNN's bf16 matmuls round a row differently
        with the number of rows (measured: K = 704, rows 25 of 36 and 3 of 80 differ by one
        ulp), so the linear layers run on ATen's own kernels (each output a float32 dot product
        in one order; about 9x slower than oneDNN's bf16 and 2.4x slower than fp32 at
        256 x 32768, which is why it is not the CPU's default dtype), and attention in float64
        (``attention.sdpa``)."""
        self.iota = Iota(self.device)
        self.features: torch.Tensor | None = None
        """The last forward's layer inputs that it was asked to keep (``forward``)."""
        self.feature_layers: tuple[int, ...] | None = None
        """The layers whose inputs the static steps keep too (``keep_features``)."""
        static = not self.batch_invariant and (compile or (cuda_graphs
                                                           and self.device.type == "cuda"))
        self.cache = KVCache(len(self.layers), budget.num_blocks, self.kv_heads, self.head_dim,
                             max_seqs, block_size, dtype, self.device, scratch=static,
                             zeroed=attention == "flex", prefix_caching=prefix_caching)
        self.graphs: StepGraphs | None = StepGraphs(self, GraphConfig(
            capture=cuda_graphs, compile=compile)) if static else None
        """Bucketed static-shape steps (``step_graphs.py``), or None: every step eager."""

    def keep_features(self, layers: tuple[int, ...]) -> None:
        """Static steps keep the inputs of ``layers`` as well (a draft head reads them on
        every step): steps built without them are dropped, to be built again."""
        if layers != self.feature_layers and self.graphs is not None:
            self.graphs.steps.clear()
        self.feature_layers = layers

    def capture_graphs(self, progress: bool = False) -> int:
        """Capture every bucket's CUDA graph now, with a progress bar; returns how many (0
        without graphs). Compiled steps are built at first use instead: a bucket compiles for
        seconds, and most buckets never come in a deployment's traffic."""
        g = self.graphs
        return g.prepare(progress=progress) if g is not None and g.capture else 0

    def _take_weights(self, hf: PreTrainedModel, vocab_limit: int | None,
                      quantize: Quantization) -> None:
        """The model's shapes and weights, q/k/v and gate/up fused (int8 where asked)."""
        cfg = hf.config
        self.heads = cfg.num_attention_heads
        shape = ModelShape.of(cfg)
        self.kv_heads, self.head_dim = shape.kv_heads, shape.head_dim
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        """Rows of the output layer (the target's distributions have this many columns)."""
        base = hf.model
        self.embed = base.embed_tokens.weight
        self.norm = base.norm.weight
        limit = min(vocab_limit or cfg.vocab_size, cfg.vocab_size)
        self.lm_head: torch.Tensor | Int8Linear = hf.lm_head.weight[:limit]          # [V', D]
        self.vocab_limit = limit
        """Columns of this model's logits: ids at or past it are never scored."""
        self.rotary = base.rotary_emb
        self.layers = [self._layer(layer) for layer in base.layers]
        if quantize == "int8":
            self.lm_head = Int8Linear(self.lm_head)
            self.layers = [_Layer(Int8Linear(w.qkv, w.qkv_bias), None, Int8Linear(w.o),
                                  Int8Linear(w.gate_up), Int8Linear(w.down), w.attn_norm,
                                  w.mlp_norm) for w in self.layers]
        self.weight_bytes = sum(t.untyped_storage().nbytes() for t in {
            t.untyped_storage().data_ptr(): t for t in self._weights()}.values())
        """Bytes of the weights (a tied embedding and output layer count once)."""

    def _weights(self) -> list[torch.Tensor]:
        """The tensors this runner computes with (as loaded; int8 layers count their packing
        as nothing: ``weight_bytes`` is then an upper bound)."""
        out = [self.embed, self.norm]
        if isinstance(self.lm_head, torch.Tensor):
            out.append(self.lm_head)
        for w in self.layers:
            out += [t for t in (w.qkv, w.qkv_bias, w.o, w.gate_up, w.down, w.attn_norm,
                                w.mlp_norm) if isinstance(t, torch.Tensor)]
        return out

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

    def reserve(self, items: list[ForwardItem]) -> None:
        """The blocks every item's new tokens need (``CacheFull``, taking none, when too few are
        free)."""
        blocks, lengths = self.cache.blocks, self.cache.lengths
        need = sum(blocks.needed(it.seq, lengths[it.seq] + len(it.tokens)) for it in items)
        if need > blocks.free_blocks:
            raise CacheFull(f"the batch needs {need} more KV blocks, {blocks.free_blocks} are free")
        for it in items:
            self.cache.reserve(it.seq, lengths[it.seq] + len(it.tokens))

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], last_only: bool = False,
                logits_from: list[int] | None = None,
                features: tuple[int, ...] | None = None) -> torch.Tensor:
        """Logits of the new tokens: [B, Lq, V'] of every new token (rows past an item's length
        are padding); with ``logits_from`` [B, Lr, V'] of item i's tokens from index
        ``logits_from[i]`` on (row j = token ``logits_from[i] + j``; a prefill's verification
        needs only its last token's row, and an output layer over a 150k vocabulary costs more
        than the rest of a small model); with ``last_only`` [B, 1, V'] of each item's last token
        (all a chain drafter needs). V' = ``vocab_limit``. ``features``: also keep the
        residual-stream inputs of these layers for every new token, concatenated, in
        ``self.features`` [B, Lq, len(features) * D] (what a draft head takes: ``eagle.py``;
        through the static steps only if they keep those layers: ``keep_features``)."""
        self.reserve(items)
        sizes = [len(it.tokens) for it in items]
        self.features = None
        if self.graphs is not None and (features or None) == self.feature_layers:
            lk = max(self.cache.lengths[it.seq] + n for it, n in zip(items, sizes))
            rows = list(iter_rows(sizes, last_only, logits_from))
            static = self.graphs.forward(items, rows, lk)
            if static is not None:
                hidden, self.features = static                  # [B, Lr, D], [B, Lq, 3D]
                return linear(hidden, self.lm_head)                           # [B, Lr, V']
        flex = self.attention == "flex"
        paged = self.cache.locate([it.seq for it in items], sizes, max(sizes), view=not flex)
        if paged.lk > self.max_len:
            raise ValueError(f"context would exceed {self.max_len} tokens")
        lay = ragged_layout([it.tokens for it in items], [it.parents for it in items],
                            [self.cache.lengths[it.seq] for it in items], paged.lk, self.iota,
                            dense_mask=not flex)
        if flex:
            lay["plan"] = self._plan(paged.table, lay["ctx"], lay["n"], max(sizes), lay["anc"])
        if not self.batch_invariant:
            return self._compute(lay, paged, sizes, last_only, logits_from, features)
        was = torch._C._get_mkldnn_enabled()
        torch._C._set_mkldnn_enabled(False)  # ATen's own matmuls (see batch_invariant)
        try:
            return self._compute(lay, paged, sizes, last_only, logits_from, features)
        finally:
            torch._C._set_mkldnn_enabled(was)

    def _plan(self, table: torch.Tensor, ctx: torch.Tensor, n: torch.Tensor, lq: int,
              anc: torch.Tensor | None) -> FlexPlan:
        """The FlexAttention block mask of one forward (every layer's)."""
        return build_plan(table, ctx, n, lq, self.cache.k.shape[1], self.cache.block_size, anc)

    def _hidden(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                paged: Paged, plan: FlexPlan | None = None,
                features: tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The decoder layers over new tokens [B, Lq] at positions [B, Lq] -> [B, Lq, D];
        attention by SDPA under ``mask``, or by FlexAttention under ``plan``; with
        ``features`` also the inputs of these layers, concatenated [B, Lq, len(features) * D]
        (else None)."""
        b, lq = tokens.shape
        x = F.embedding(tokens, self.embed)                                           # [B, Lq, D]
        cos, sin = self.rotary(x, positions)                                          # [B, Lq, hd]
        cos, sin = cos[:, :, None], sin[:, :, None]                                   # [B, Lq, 1, hd]
        kept: dict[int, torch.Tensor] = {}
        for li, w in enumerate(self.layers):
            if features and li in features:
                kept[li] = x
            h = self._rms(x, w.attn_norm)
            qkv = linear(h, w.qkv, w.qkv_bias).view(b, lq, -1, self.head_dim)
            q, k, v = qkv.split((self.heads, self.kv_heads, self.kv_heads), dim=2)     # [B, Lq, *, hd]
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
            self.cache.write(li, paged, k, v)
            if plan is not None:
                attn = paged_tree_attention(q.transpose(1, 2), self.cache.k[li], self.cache.v[li],
                                            plan)                                     # [B, H, Lq, hd]
            else:
                keys, values = self.cache.read(li, paged)                             # [B, KVH, Lk, hd]
                attn = sdpa(q.transpose(1, 2), keys, values, mask, self.batch_invariant)
            x = x + linear(attn.transpose(1, 2).reshape(b, lq, -1), w.o)
            gate, up = linear(self._rms(x, w.mlp_norm), w.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(gate) * up, w.down)
        return x, torch.cat([kept[li] for li in features], dim=-1) if features else None

    def static_body(self, tokens: torch.Tensor, ctx: torch.Tensor, n: torch.Tensor,
                    anc: torch.Tensor, table: torch.Tensor, slots: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A bucket's step (``step_graphs.py``): tokens [Bb, Qb], ctx [Bb], n [Bb],
        anc [Bb, Qb, Qb], table [Bb, MB], slots [Bb * Qb] -> normed hidden states [Bb, Qb, D]
        and the inputs of ``feature_layers`` [Bb, Qb, 3D] (None without); fixed shapes, no host
        reads (captured as a CUDA graph)."""
        paged = static_paged(table, slots, self.cache.block_size)
        flex = self.attention == "flex"
        positions, mask = static_mask(ctx, n, anc, paged.lk, dense=not flex)
        plan = self._plan(table, ctx, n, anc.shape[1], anc.bool()) if flex else None
        x, kept = self._hidden(tokens, positions, mask, paged, plan, self.feature_layers)
        return self._rms(x, self.norm), kept

    def _compute(self, lay: dict[str, torch.Tensor | None], paged: Paged, sizes: list[int],
                 last_only: bool, logits_from: list[int] | None,
                 features: tuple[int, ...] | None = None) -> torch.Tensor:
        x, self.features = self._hidden(lay["tokens"], lay["positions"], lay["mask"], paged,
                                        lay.get("plan"), features)                    # [B, Lq, D]
        b = x.shape[0]
        if last_only:
            logits_from = [n - 1 for n in sizes]
        if logits_from is not None and any(logits_from):
            rows = to_device(list(iter_rows(sizes, False, logits_from)), self.device)  # [B, Lr]
            x = x.gather(1, rows[:, :, None].expand(b, rows.shape[1], x.shape[-1]))    # [B, Lr, D]
        return linear(self._rms(x, self.norm), self.lm_head)                          # [B, Lr, V']


def describe(runner: ModelRunner) -> str:
    """One line on where a runner runs and what its cache holds (logged at start)."""
    blocks = runner.cache.blocks
    return (f"on {runner.device} in {str(runner.dtype).removeprefix('torch.')}: weights "
            f"{format_size(runner.weight_bytes)}, KV cache {format_size(runner.cache.nbytes)} = "
            f"{blocks.num_blocks} blocks of {blocks.block_size} tokens "
            f"({blocks.capacity_tokens} tokens), max model len {runner.max_len}, "
            f"up to {blocks.max_seqs} requests; {describe_graphs(runner.graphs)}")
