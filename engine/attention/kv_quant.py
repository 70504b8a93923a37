"""The FP8 KV cache's number format, one definition for every backend: a cache tensor of
torch.float8_e4m3fn or torch.float8_e5m2 with, per layer, float32 scales k_scale and v_scale of
shape [num_kv_heads] (per-tensor scaling is one value repeated).

Stored = fp8(clamp(x / scale[head], -max, max)); read = float(stored) * scale[head]. The clamp
keeps a value past the calibrated range at the format's largest finite value instead of NaN
(torch's cast does not saturate).
"""

from __future__ import annotations

import re

import torch

from kvpilot.contract.engine_choices import KV_CACHE_DTYPES

FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for a --kv-cache-dtype value ('auto': the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in FP8_KV_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return FP8_KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] (any float dtype), scale [num_kv_heads] -> fp8 `dtype`."""
    limit = fp8_max(dtype)
    return (x.float() / scale[:, None]).clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., num_kv_heads, head_dim] in fp8, scale [num_kv_heads] -> `dtype`."""
    return (x.float() * scale[:, None]).to(dtype)


# A checkpoint tensor that is a KV-cache scale (kv_cache/kv_scales.py reads them), not a weight.
KV_SCALE_NAME = re.compile(
    r"^model\.layers\.(\d+)\.self_attn\.(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
    r"v_proj\.output_scale)$"
)


def is_kv_scale_name(name: str) -> bool:
    """A checkpoint tensor that is a KV-cache scale, not a weight."""
    return KV_SCALE_NAME.match(name) is not None
