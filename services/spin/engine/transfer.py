"""Host data to the device without waiting for the device.

A plain ``torch.tensor(data, device="cuda")`` (or ``.to("cuda")`` of pageable memory) copies and
then synchronises the stream: the host waits for every forward already queued, which undoes the
overlap of one micro-batch's preparation with the other's computation (``Verifier.start``).
Staged in pinned memory, the copy is queued on the stream like a kernel and the host goes on.
Stream order keeps it correct: the copy lands before any kernel queued after it reads it, and
the staging buffer is not reused until the copy has happened (PyTorch's pinned allocator records
the copy's stream).
"""

from __future__ import annotations

import torch


def to_device(data: object, device: torch.device | str, dtype: torch.dtype | None = None
              ) -> torch.Tensor:
    """``data`` (a host tensor, or what ``torch.tensor`` takes) on ``device``: on CUDA through
    pinned memory and a non-blocking copy, elsewhere as ``torch.tensor`` / ``.to`` would."""
    device = torch.device(device)
    host = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and host.dtype != dtype:
        host = host.to(dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
