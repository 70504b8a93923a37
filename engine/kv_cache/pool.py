"""The KV cache's memory: one K and one V tensor per layer on the model's device, in the model's
dtype (PagedKVPool) or in FP8 with per-head scales (Fp8KVPool); build_kv_pool picks and sizes one
(base.KVCachePool)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.attention.base import fp8_refusal
from kvpilot.engine.attention.kv_quant import is_fp8, kv_storage_dtype
from kvpilot.engine.kv_cache.base import KVCachePool
from kvpilot.engine.kv_cache.budget import DraftReserve, decide_num_blocks, kv_bytes_per_block
from kvpilot.engine.kv_cache.kv_scales import KVScales, calibrate_scales, read_checkpoint_scales
from kvpilot.engine.kv_cache.scales_cache import (
    read_cached_scales,
    scales_key,
    scales_path,
    write_cached_scales,
)

if TYPE_CHECKING:
    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.model.llama import LlamaForCausalLM
    from kvpilot.engine.model.loader import ResolvedModel
    from kvpilot.engine.parallel.group import TPGroup

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class KVLayout:
    """The shape of the pool on this rank."""

    num_layers: int
    num_kv_heads: int  # this rank's
    head_dim: int
    block_size: int


class PagedKVPool(KVCachePool):
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        with_null_block: bool = False,
    ) -> None:
        """with_null_block: one block past the block manager's, where padded rows of a captured
        graph write and read without touching a sequence's blocks."""
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_size = layout.block_size
        self.dtype = dtype
        self.device = device
        self.null_block = num_blocks if with_null_block else None
        shape = (
            num_blocks + (1 if with_null_block else 0),
            layout.block_size,
            layout.num_kv_heads,
            layout.head_dim,
        )
        self._layers = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(layout.num_layers)
        ]  # fmt: skip
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.2f GiB)",
            num_blocks,
            self.block_size,
            num_blocks * self.block_size,
            num_blocks * self.bytes_per_block / 2**30,
        )

    @property
    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._layers

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.layout, self.dtype)


def bytes_per_block(layout: KVLayout, dtype: torch.dtype) -> int:
    return kv_bytes_per_block(
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        block_size=layout.block_size,
        itemsize=torch.empty((), dtype=dtype).element_size(),
    )


class Fp8KVPool(PagedKVPool):
    """K and V in 8-bit floats (torch.float8_e4m3fn or float8_e5m2) with a scale per layer and KV
    head (kv_quant.py): half the bytes of a bfloat16 block, a quarter of a float32 one, so the
    same budget holds twice (four times) the tokens."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        dtype: torch.dtype,
        device: torch.device,
        scales: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        with_null_block: bool = False,
    ) -> None:
        if not is_fp8(dtype):
            raise ValueError(f"Fp8KVPool stores float8_e4m3fn or float8_e5m2, got {dtype}")
        if len(scales) != layout.num_layers:
            raise ValueError(f"{len(scales)} layers of KV scales for {layout.num_layers} layers")
        for k_scale, v_scale in scales:
            for s in (k_scale, v_scale):
                if s.shape != (layout.num_kv_heads,):
                    raise ValueError(
                        f"KV scales must have shape [{layout.num_kv_heads}], got {tuple(s.shape)}"
                    )
        super().__init__(layout, num_blocks, dtype, device, with_null_block=with_null_block)
        self._scales = [
            (k.to(device=device, dtype=torch.float32).contiguous(),
             v.to(device=device, dtype=torch.float32).contiguous())
            for k, v in scales
        ]  # fmt: skip

    @property
    def scales(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return self._scales


def calibrated_scales(
    model: LlamaForCausalLM,
    source: ResolvedModel,
    fp8_dtype: torch.dtype,
    model_dtype: torch.dtype,
    device: torch.device,
    layout: KVLayout,
    tp: TPGroup | None,
) -> KVScales:
    """Calibrated scales (kv_scales.py), read from an earlier start's calibration where every
    rank has it (the ranks calibrate together: collectives run inside the forward), else
    calibrated and kept (scales_cache.py). Random weights (load_format dummy) are never kept."""
    from kvpilot.engine.model.gguf_convert import cache_root

    path = None
    cached = None
    if source.load_format != "dummy":
        key = scales_key(
            source.hf_dir,
            fp8_dtype,
            model_dtype,
            device.type,
            model.shard.kv_head_start,
            layout.num_kv_heads,
        )
        path = scales_path(cache_root(), key)
        cached = read_cached_scales(path, layout.num_layers, layout.num_kv_heads)
    if tp is not None and tp.min_over_ranks(int(cached is not None), device) == 0:
        cached = None
    if cached is not None:
        log.info("FP8 KV scales from %s (calibrated at an earlier start)", path)
        return cached
    scales = calibrate_scales(model, fp8_dtype, model_dtype, device, layout.block_size)
    if path is not None:
        write_cached_scales(path, scales)
    return scales


def build_kv_pool(
    config: EngineConfig,
    model: LlamaForCausalLM,
    source: ResolvedModel,
    layout: KVLayout,
    model_dtype: torch.dtype,
    device: torch.device,
    tp: TPGroup | None,
    *,
    with_null_block: bool,
    draft: DraftReserve | None = None,
) -> PagedKVPool:
    """The pool config.cache asks for, sized by its budget (less a draft model's share, see
    decide_num_blocks): K and V in the model's dtype, or FP8 with the checkpoint's scales, else
    calibrated ones (kv_scales.py)."""
    dtype = kv_storage_dtype(config.cache.kv_cache_dtype, model_dtype)
    num_blocks = decide_num_blocks(config.cache, device, bytes_per_block(layout, dtype), tp, draft)
    if not is_fp8(dtype):
        return PagedKVPool(layout, num_blocks, dtype, device, with_null_block=with_null_block)
    backend = model.model.layers[0].self_attn.backend
    if not getattr(backend, "reads_fp8", False):
        raise ValueError(fp8_refusal(backend.name))
    shard = model.shard
    scales = None
    if source.load_format != "dummy":
        scales = read_checkpoint_scales(
            source.hf_dir,
            layout.num_layers,
            layout.num_kv_heads,
            shard.kv_head_start,
            model.config.num_key_value_heads,
        )
    if scales is None:
        scales = calibrated_scales(model, source, dtype, model_dtype, device, layout, tp)
    else:
        log.info("FP8 KV scales from the checkpoint")
    return Fp8KVPool(layout, num_blocks, dtype, device, scales, with_null_block=with_null_block)
