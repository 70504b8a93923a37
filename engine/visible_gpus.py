"""The NVIDIA GPUs CUDA will show this process, counted without CUDA or torch.

`kvpilot serve` checks its placement before the engine core starts; asking torch would import it
(1-3 s on a GPU node) in the API process, which otherwise loads its tokenizer without torch while
the core loads the weights (engine/model/files.py torch_kept_out). The count:

- NVIDIA's per-GPU device nodes, /dev/nvidiaN: a container gets the nodes of its own GPUs alone
  (the NVIDIA container runtime mounts what the device plugin allotted), and CUDA numbers the
  devices it can open from 0. Without /dev/nvidiactl, which every CUDA process opens, none.
- narrowed by CUDA_VISIBLE_DEVICES as CUDA reads it: empty, none; else its entries in order up to
  the first that names no device (a negative or unparsable ordinal, or one past the devices
  there), every entry a UUID (GPU-..., MIG-...) where the first is one; an ordinal given twice
  makes the whole list invalid, so none.

The engine core checks again with torch's own count once it has imported torch: a node present
for a GPU the driver cannot use ends the load with the same readable error.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

DEV = Path("/dev")
NVIDIA_CONTROL_NODE = "nvidiactl"
GPU_NODE = re.compile(r"nvidia(\d+)")
UUID_PREFIXES = ("GPU-", "MIG-")


def gpu_node_count(dev: Path = DEV) -> int:
    """The NVIDIA GPUs whose device nodes are in `dev` (0 without the control node)."""
    if not (dev / NVIDIA_CONTROL_NODE).exists():
        return 0
    try:
        names = os.listdir(dev)
    except OSError:
        return 0
    return sum(1 for name in names if GPU_NODE.fullmatch(name))


def leading_ordinal(entry: str) -> int | None:
    """The decimal number an entry starts with, as CUDA reads one ("1abc" is 1), else None."""
    digits = re.match(r"-?\d+", entry.strip())
    return int(digits.group()) if digits else None


def count_visible(num_devices: int, cuda_visible_devices: str | None) -> int:
    """How many of `num_devices` CUDA_VISIBLE_DEVICES leaves visible (module docstring)."""
    if cuda_visible_devices is None:
        return num_devices
    entries = [entry.strip() for entry in cuda_visible_devices.split(",")]
    if entries == [""]:
        return 0
    if entries[0].startswith(UUID_PREFIXES):
        uuids = 0
        for entry in entries:
            if not entry.startswith(UUID_PREFIXES):
                break
            uuids += 1
        return min(uuids, num_devices)
    seen: list[int] = []
    for entry in entries:
        ordinal = leading_ordinal(entry)
        if ordinal is None or ordinal < 0 or ordinal >= num_devices:
            break
        if ordinal in seen:
            return 0
        seen.append(ordinal)
    return len(seen)


def visible_gpu_count(dev: Path = DEV, env: Mapping[str, str] = os.environ) -> int:
    """The GPUs CUDA will show this process (module docstring)."""
    return count_visible(gpu_node_count(dev), env.get("CUDA_VISIBLE_DEVICES"))
