"""Int8 weights for draft models on CPU (dynamic quantization: int8 weights, fp32 activations).

A draft model's forward of one token is bound by reading its weights, not by arithmetic: the
demo's draft-code (2 layers, hidden 192, vocabulary 4096) holds 6.7 MB of fp32 weights for
1.7 M multiply-adds per token, and in serving the verifier's forward (62 MB) evicts them from the
cache between steps. Int8 weights are a quarter of the bytes. Each output channel has its own
scale (the largest absolute weight of that row / 127); activations are quantized per call by
fbgemm's dynamic linear, which computes in int8 and rescales to fp32.

Only drafters take this: a draft token is verified by the target either way, so int8 drafts can
change which tokens are proposed (the acceptance rate) but never the output. The target keeps
its exact weights (lossless is defined against them).

Measured on the demo family (2 cores; two embedded deployments side by side, requests alternating
between them, 9 requests one at a time, medians of 2 rounds): fixed draft-code k=4 took 0.91 of
the fp32 time, draft-prose 0.84, draft-general 0.94, draft-structured (1.7 MB in fp32) 0.99, with
the same accepted tokens (draft-code 331 against 329 of about 960 drafted). Greedy next-token
predictions of draft-code agree with fp32 at 96.5% of held-out positions (``tests``).
"""

from __future__ import annotations

import functools
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from .memory import resolve_dtype

Quantization = Literal["none", "int8"]
"""Weights of a model runner's linear layers: as loaded, or int8 per output channel."""


class Int8Linear:
    """A linear layer with int8 weights (per output channel) for fp32 inputs, on CPU (the
    model runner refuses int8 elsewhere, before loading)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().float()                                              # [N, K]
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)                   # [N]
        zero = torch.zeros_like(scale, dtype=torch.long)                         # [N]
        with warnings.catch_warnings():  # quantized tensors are the packing's input format only
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale.double(), zero, 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(
            q, None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] fp32 -> [..., N] fp32."""
        return torch.ops.quantized.linear_dynamic(x, self._packed)


@functools.cache
def available() -> bool:
    """Whether this torch build has the int8 CPU kernels (fbgemm or x86) and the packing API
    (torch has deprecated quantized tensors; a build without them serves weights as loaded)."""
    if not any(e in torch.backends.quantized.supported_engines for e in ("fbgemm", "x86")):
        return False
    try:
        Int8Linear(torch.ones(2, 2))(torch.ones(1, 2))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True


def int8_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether int8 weights can serve a model on ``device`` in ``dtype``: on the CPU in float32
    only (the kernels take fp32 activations; CUDA has none)."""
    return device.type == "cpu" and dtype == torch.float32


def resolve(choice: str, device: torch.device | str = "cpu",
            dtype: torch.dtype | str = torch.float32) -> Quantization:
    """The weights of a model on ``device`` in ``dtype`` ('auto': the runner's, float32 on the
    CPU): 'auto' -> 'int8' where it runs (``int8_runs``) and this torch has the kernels
    (``available``), else 'none'; 'none' as it is; 'int8' where it cannot run: ValueError."""
    if choice not in ("auto", "none", "int8"):
        raise ValueError(f"quantization must be 'auto', 'none' or 'int8', got {choice!r}")
    device = torch.device(device)
    if isinstance(dtype, str):
        dtype = resolve_dtype(dtype, device)
    runs = int8_runs(device, dtype)
    if choice == "int8" and not runs:
        raise ValueError(f"int8 weights need device='cpu' and dtype=float32, not "
                         f"device={str(device)!r} and dtype={str(dtype).removeprefix('torch.')}")
    if choice == "auto":
        return "int8" if runs and available() else "none"
    return choice  # type: ignore[return-value]


def linear(x: torch.Tensor, w: torch.Tensor | Int8Linear, bias: torch.Tensor | None = None,
           ) -> torch.Tensor:
    """``F.linear`` for a weight as loaded, or an ``Int8Linear`` (its bias is packed in it)."""
    if isinstance(w, Int8Linear):
        return w(x)
    return F.linear(x, w, bias)
