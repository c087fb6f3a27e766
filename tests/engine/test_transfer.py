"""Host data reaches the device with its values and dtype (pinned and non-blocking on CUDA)."""

from __future__ import annotations

import pytest
import torch

from spin.engine.transfer import to_device


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_values_and_dtypes_arrive(device: str) -> None:
    rows = [[3, -1, 7], [0, 2, 5]]
    out = to_device(rows, device)
    assert out.device.type == device and out.dtype == torch.long
    assert out.cpu().tolist() == rows
    probs = torch.rand(4, 9, dtype=torch.float16)
    moved = to_device(probs, device)
    assert moved.dtype == torch.float16 and torch.equal(moved.cpu(), probs)
    assert to_device([1.5, 2.5], device, torch.float32).cpu().tolist() == [1.5, 2.5]
    assert to_device(torch.arange(4), device, torch.int32).dtype == torch.int32
