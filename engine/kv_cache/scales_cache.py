"""Calibrated FP8 KV scales kept for the next start: calibration (kv_scales.py) runs its tokens
through the model at every load otherwise, 0.3-0.5 s for SmolLM2 on 2 cores and tens of seconds
for an 8B model on a CPU.

One file per model version, dtypes, device kind and rank's KV heads, under the model cache
(KVPILOT_CACHE_DIR: a pod's model-cache volume, shared by its replicas):
`kv_scales/<key>.safetensors`. The key hashes what the scales depend on: the model's files as they
are (each weight file's and config.json's path, size, mtime and inode: a new or rewritten file
misses), the FP8 and model dtypes, the device kind, the KV heads and the calibration's constants.
A file that cannot be read or does not fit the model is a miss, and is written again; a cache
that cannot be written only costs the next start its calibration.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from kvpilot.engine.kv_cache.kv_scales import (
    CALIBRATION_MARGIN,
    CALIBRATION_SEED,
    CALIBRATION_TOKENS,
    KVScales,
)
from kvpilot.engine.model.files import file_identity

log = logging.getLogger("kvpilot")

# Raised when what a cached file means changes, so that older files miss.
FORMAT_VERSION = 1


def model_file_identity(hf_dir: Path) -> list[str]:
    """The identity (files.file_identity) of each file the model's numbers come from."""
    return [
        file_identity(file)
        for file in sorted([*hf_dir.glob("*.safetensors"), hf_dir / "config.json"])
    ]


def scales_key(
    hf_dir: Path,
    fp8_dtype: torch.dtype,
    model_dtype: torch.dtype,
    device_type: str,
    kv_head_start: int,
    num_kv_heads: int,
) -> str:
    """The cache key of one rank's calibrated scales (module docstring)."""
    parts = [
        f"format {FORMAT_VERSION}",
        f"calibration {CALIBRATION_TOKENS} tokens, seed {CALIBRATION_SEED}, "
        f"margin {CALIBRATION_MARGIN}",
        f"{fp8_dtype} over {model_dtype} on {device_type}",
        f"KV heads {kv_head_start}..{kv_head_start + num_kv_heads}",
        *model_file_identity(hf_dir),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def scales_path(cache_root: Path, key: str) -> Path:
    return cache_root / "kv_scales" / f"{key}.safetensors"


def read_cached_scales(path: Path, num_layers: int, num_kv_heads: int) -> KVScales | None:
    """The scales kept at `path`, or None where there are none, or none that fit this model."""
    try:
        tensors = load_file(str(path))
    except FileNotFoundError:
        return None
    except (OSError, SafetensorError) as exc:
        log.warning("FP8 KV scales cache %s unreadable (%s): calibrating again", path, exc)
        return None
    scales = [
        (tensors.get(f"layers.{layer}.k"), tensors.get(f"layers.{layer}.v"))
        for layer in range(num_layers)
    ]
    if len(tensors) != 2 * num_layers or not all(
        fits(value, num_kv_heads) for pair in scales for value in pair
    ):
        log.warning("FP8 KV scales cache %s does not fit the model: calibrating again", path)
        return None
    return scales  # type: ignore[return-value]


def fits(value: torch.Tensor | None, num_kv_heads: int) -> bool:
    return (
        value is not None
        and value.dtype == torch.float32
        and value.shape == (num_kv_heads,)
        and bool(torch.isfinite(value).all())
        and bool((value > 0).all())
    )


def write_cached_scales(path: Path, scales: KVScales) -> None:
    """Keeps the scales at `path`, whole or not at all: written to a file of its own beside it (a
    name no other writer has, pods on a shared volume included), then renamed over it."""
    tensors = {}
    for layer, (k, v) in enumerate(scales):
        tensors[f"layers.{layer}.k"] = k.detach().to("cpu", torch.float32).contiguous()
        tensors[f"layers.{layer}.v"] = v.detach().to("cpu", torch.float32).contiguous()
    tmp: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(handle)
        tmp = Path(name)
        save_file(tensors, name)
        tmp.replace(path)
    except OSError as exc:
        log.info("FP8 KV scales not kept (%s): the next start calibrates again", exc)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
