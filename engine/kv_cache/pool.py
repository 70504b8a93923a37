"""The KV cache's memory: one K and one V tensor per layer, in the model's dtype, on the model's
device (base.KVCachePool)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvpilot.engine.kv_cache.base import KVCachePool
from kvpilot.engine.kv_cache.budget import kv_bytes_per_block

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
