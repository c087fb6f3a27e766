"""Model shapes of ``spin bench gpu``: random-initialised Llama-architecture models built on the
device, and the timing helpers every part shares.

Shapes are the published configurations' (no weights are read or downloaded): a Llama-3-8B
target, and drafters of about 68M (JackFram/llama-68m), 160M (JackFram/llama-160m) and 1.2B
(Llama-3.2-1B) parameters; ``--quick`` uses tiny shapes of the same architecture. A model is
built directly on its device and in its dtype (default device and dtype set while the modules
are created), never on the CPU first: 8B parameters would take 32 GB of host memory in float32.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from ..timing.measure import steady_time


@dataclass(frozen=True)
class Shape:
    """One Llama-architecture shape."""

    name: str
    """Label in the report."""
    hidden: int
    """Hidden size D."""
    layers: int
    """Decoder layers."""
    heads: int
    """Attention heads (head dim = hidden / heads)."""
    kv_heads: int
    """Key/value heads (grouped-query attention when fewer than ``heads``)."""
    intermediate: int
    """MLP intermediate size."""
    vocab: int
    """Vocabulary size (a drafter of the target shares it in serving; not required here)."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    tied: bool = False
    """Output layer tied to the embedding."""

    @property
    def params(self) -> int:
        """Parameters (a tied output layer counted once)."""
        hd = self.hidden // self.heads
        attn = 2 * self.hidden * self.heads * hd + 2 * self.hidden * self.kv_heads * hd
        layer = attn + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embed = self.vocab * self.hidden
        return self.layers * layer + embed * (1 if self.tied else 2) + self.hidden

    def config(self, max_len: int = 8192) -> LlamaConfig:
        """The transformers config of this shape."""
        return LlamaConfig(vocab_size=self.vocab, hidden_size=self.hidden,
                           intermediate_size=self.intermediate, num_hidden_layers=self.layers,
                           num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                           rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
                           max_position_embeddings=max_len, tie_word_embeddings=self.tied,
                           rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

    def as_dict(self) -> dict:
        return {"name": self.name, "hidden": self.hidden, "layers": self.layers,
                "heads": self.heads, "kv_heads": self.kv_heads,
                "intermediate": self.intermediate, "vocab": self.vocab,
                "rope_theta": self.rope_theta, "tied": self.tied, "params": self.params}


LLAMA3_8B = Shape("llama-3-8b", 4096, 32, 32, 8, 14336, 128256, 500000.0)
DRAFTERS = (Shape("llama-68m", 768, 2, 12, 12, 3072, 32000),
            Shape("llama-160m", 768, 12, 12, 12, 3072, 32000),
            Shape("llama-3.2-1b", 2048, 16, 32, 8, 8192, 128256, 500000.0, tied=True))
"""About 68M, 160M and 1.2B parameters; the last shares the target's vocabulary (the assistant
of transformers' assisted generation in the baselines)."""
TINY_TARGET = Shape("tiny-target", 128, 2, 4, 2, 256, 512, 500000.0)
TINY_DRAFTERS = (Shape("tiny-draft-a", 64, 1, 2, 2, 128, 512),
                 Shape("tiny-draft-b", 96, 2, 2, 1, 192, 512, tied=True))


@contextlib.contextmanager
def _building_on(device: torch.device, dtype: torch.dtype) -> Iterator[None]:
    """New tensors on ``device`` in ``dtype`` (floating point ones) while inside."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            yield
    finally:
        torch.set_default_dtype(old)


def build_random(shape: Shape, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 max_len: int = 8192) -> PreTrainedModel:
    """A randomly initialised ``LlamaForCausalLM`` of ``shape``, built on ``device`` in
    ``dtype`` (transformers' own initialisation: normal, std 0.02), in eval mode. Buffers the
    model creates in float32 on purpose (the rotary frequencies) stay float32, as
    ``from_pretrained(dtype=...)`` leaves them: no ``.to(dtype)`` of the whole model."""
    torch.manual_seed(seed)
    with _building_on(device, dtype):
        model = LlamaForCausalLM(shape.config(max_len))
    return model.eval()


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_time(fn, device: torch.device, reps: int) -> float:
    """Seconds of ``fn()`` (``steady_time`` of ``reps`` calls), each call timed to the end of
    its device work (synchronised before and after)."""
    sync(device)

    def call() -> None:
        fn()
        sync(device)

    return steady_time(call, reps)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> float:
    """Device memory bandwidth (bytes/s) of a large device-to-device copy: bytes read plus
    bytes written over the copy's median time."""
    n = nbytes // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)                           # [n]
    dst = torch.empty_like(src)
    secs = device_time(lambda: dst.copy_(src), device, reps)
    del src, dst
    return 2 * 2 * n / secs


def finite_positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


class Budget:
    """A time budget (seconds from creation): ``left()``, ``over()``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def over(self) -> bool:
        return self.left() <= 0
