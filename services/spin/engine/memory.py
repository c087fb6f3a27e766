"""Where a model runs and how much memory its KV cache gets: device, dtype, byte sizes, budgets.

One place for the rules the model runner applies when it loads and ``spin plan`` applies to a
config alone (no weights read), so the plan is what a service will do:

- ``--device auto``: CUDA when present, else the CPU. ``--dtype auto``: float32 on the CPU (its
  bf16 matmuls are slower than fp32 on most CPUs), the checkpoint's dtype on CUDA.
- ``--kv-cache-memory SIZE`` is the KV cache's budget. Without it: ``CPU_KV_CACHE_DEFAULT`` on the
  CPU; on CUDA ``--gpu-memory-utilization`` of the GPU less the weights and an activation reserve
  (the largest forward's logits and hidden states), as vLLM does.
- The cache is a whole number of blocks; ``--max-model-len`` caps one request and must fit in
  it (without the flag: the model's context, or what the cache holds if that is less).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

CPU_KV_CACHE_DEFAULT = 512 << 20
"""KV cache budget on the CPU when none is given (bytes). Pages are touched as blocks are first
used, so an idle service does not hold it."""
MAX_BATCH_TOKENS = 2048
"""Tokens of the largest forward the activation reserve provides for (a prefill chunk or a batch
of drafted trees)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "t": 1e12, "tb": 1e12, "ki": 1 << 10, "kib": 1 << 10, "mi": 1 << 20, "mib": 1 << 20,
          "gi": 1 << 30, "gib": 1 << 30, "ti": 1 << 40, "tib": 1 << 40}


def parse_size(text: str | int) -> int:
    """'64MiB', '20GiB', '1.5G', '512Mi', '4096' -> bytes (Kubernetes and IEC suffixes both)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 64MiB, 20GiB, 512Mi, 1.5G)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be > 0, got {text!r}")
    return value


def format_size(n: float) -> str:
    """Bytes as the largest IEC unit that keeps a number >= 1 (e.g. '1.5 GiB')."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def resolve_device(choice: str) -> torch.device:
    """'auto' -> cuda when available, else cpu; 'cpu', 'cuda', 'cuda:N' as they are."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", choice):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {choice!r}")
    device = torch.device(choice)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {choice!r}: this machine has no CUDA device")
    return device


def resolve_dtype(choice: str, device: torch.device, checkpoint_dtype: object = None) -> torch.dtype:
    """'auto' -> float32 on the CPU, the checkpoint's dtype (float32 if it names none) on CUDA."""
    if choice != "auto":
        if choice not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {choice!r}")
        return DTYPES[choice]
    if device.type == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, torch.dtype):
        return checkpoint_dtype
    return DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)


@dataclass(frozen=True)
class ModelShape:
    """What sizes a model's memory: read from its config, no weights."""

    num_layers: int
    hidden_size: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int

    @classmethod
    def of(cls, cfg) -> ModelShape:
        heads = cfg.num_attention_heads
        return cls(cfg.num_hidden_layers, cfg.hidden_size,
                   getattr(cfg, "num_key_value_heads", None) or heads,
                   getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.vocab_size,
                   cfg.max_position_embeddings)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Keys and values of one token position in every layer."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * _itemsize(dtype)

    def activation_bytes(self, dtype: torch.dtype, tokens: int = MAX_BATCH_TOKENS) -> int:
        """Peak activations of a forward over ``tokens`` tokens: fp32 logits (and their
        probabilities) over the vocabulary, and a few hidden-state-sized buffers."""
        return tokens * (2 * 4 * self.vocab_size + 8 * self.hidden_size * _itemsize(dtype))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class CacheBudget:
    """A KV cache's size."""

    bytes: int
    """Budget in bytes (a whole number of blocks)."""
    num_blocks: int
    block_size: int
    max_model_len: int
    """Longest request (prompt + output) a service admits."""

    @property
    def tokens(self) -> int:
        """Token positions the cache holds at once (all requests together)."""
        return self.num_blocks * self.block_size


def kv_budget(shape: ModelShape, dtype: torch.dtype, device: torch.device, block_size: int,
              kv_cache_bytes: int | None = None, weight_bytes: int = 0,
              gpu_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
              max_model_len: int | None = None) -> CacheBudget:
    """The cache a model gets (``ValueError`` with the numbers when it cannot hold one request of
    ``max_model_len`` tokens, or the budget leaves no block)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {gpu_memory_utilization}")
    per_block = shape.kv_bytes_per_token(dtype) * block_size
    if kv_cache_bytes is None:
        if device.type == "cuda":
            total = gpu_memory_bytes or torch.cuda.get_device_properties(device).total_memory
            kv_cache_bytes = int(total * gpu_memory_utilization) - weight_bytes \
                - shape.activation_bytes(dtype)
            if kv_cache_bytes < per_block:
                raise ValueError(
                    f"no room for a KV cache: {gpu_memory_utilization:.0%} of "
                    f"{format_size(total)} less the weights ({format_size(weight_bytes)}) and "
                    f"activations ({format_size(shape.activation_bytes(dtype))}) leaves "
                    f"{format_size(kv_cache_bytes)}")
        else:
            kv_cache_bytes = CPU_KV_CACHE_DEFAULT
    blocks = kv_cache_bytes // per_block
    if blocks < 1:
        raise ValueError(f"a KV cache of {format_size(kv_cache_bytes)} holds no block of "
                         f"{block_size} tokens ({format_size(per_block)} each)")
    capacity = blocks * block_size
    if max_model_len is None:
        max_model_len = min(shape.max_position_embeddings, capacity)
    elif max_model_len > capacity:
        raise ValueError(f"--max-model-len {max_model_len} does not fit the KV cache: "
                         f"{format_size(blocks * per_block)} holds {capacity} tokens; give more "
                         f"memory or a shorter --max-model-len")
    elif max_model_len > shape.max_position_embeddings:
        raise ValueError(f"--max-model-len {max_model_len} exceeds the model's context "
                         f"({shape.max_position_embeddings} positions)")
    if max_model_len < 2:
        raise ValueError(f"max model length {max_model_len} leaves no room for a request")
    return CacheBudget(blocks * per_block, blocks, block_size, max_model_len)
