"""Host values to the device without waiting for the device.

A copy from pageable host memory may make the CUDA driver wait for the work already queued on the
stream before it stages the bytes; with async scheduling (engine/core/engine_core.py) that would
stall step N+1's input building until step N finished, undoing the overlap. Through pinned memory
the copy is queued like a kernel. (PyTorch's pinned-memory cache keeps a block from reuse until
the copies reading it are done.)
"""

from __future__ import annotations

import torch


def to_device(
    values: list[int] | list[float] | list[list[int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """values as a tensor of dtype on device; queued, not waited for, on CUDA."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
