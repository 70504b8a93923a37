"""The adapters' weights on the device: max_loras slots per projection, stacked so that one batched
call (engine/lora/ops.py) serves every adapter of a step. Filling a slot copies an adapter's
weights into it (this rank's slice of them under tensor parallelism); the model reads the stacks.

Under tensor parallelism each stack is split like its base projection: q/k/v and gate/up are split
by output rows (B's rows; A is whole), o and down by input columns (A's columns; B is whole), so a
row-parallel projection's delta is a partial sum that the all-reduce after it completes, as it
does the base projection's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvpilot.engine.config import ModelConfig
from kvpilot.engine.lora.adapter import LoRAAdapter, module_shape
from kvpilot.engine.parallel.sharding import Shard

# Each merged projection of the model and the PEFT modules it holds, in its output order.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
# Which module of a decoder layer holds each merged projection.
_PARENT = {
    "qkv_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_up_proj": "mlp",
    "down_proj": "mlp",
}


@dataclass(frozen=True)
class LoRAProjection:
    """One projection's stacks (engine/lora/ops.py's layout): lora_a [slots, subs, rank, in],
    lora_b [slots, out, rank], bounds: the subs' output rows."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    bounds: tuple[int, ...]


class LoRASlots:
    """The stacks of every projection of every layer, attached to the model's modules as
    `<projection>_lora` (the model adds their delta when a step maps tokens to slots)."""

    def __init__(
        self,
        layers: nn.ModuleList,
        cfg: ModelConfig,
        shard: Shard,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.cfg, self.shard, self.num_slots, self.max_rank = cfg, shard, num_slots, max_rank
        self.layers: list[dict[str, LoRAProjection]] = []
        for layer in layers:
            projections = {}
            for name, subs in PROJECTIONS.items():
                outs = [self._rows(0, sub) for sub in subs]
                fan_in = self._fan_in(subs[0])
                bounds = [0]
                for stop, start in ((hi, lo) for lo, hi in outs):
                    bounds.append(bounds[-1] + stop - start)
                projection = LoRAProjection(
                    torch.zeros(num_slots, len(subs), max_rank, fan_in, dtype=dtype, device=device),
                    torch.zeros(num_slots, bounds[-1], max_rank, dtype=dtype, device=device),
                    tuple(bounds),
                )
                setattr(
                    getattr(layer, _PARENT[name]), f"{name.removesuffix('_proj')}_lora", projection
                )
                projections[name] = projection
            self.layers.append(projections)
        self.slot_names: list[str | None] = [None] * num_slots

    @property
    def nbytes(self) -> int:
        return sum(
            p.lora_a.nbytes + p.lora_b.nbytes for layer in self.layers for p in layer.values()
        )

    def _source_slice(self, layer: int, module: str) -> tuple[int, int, int] | None:
        return self.shard.source_slice(f"model.layers.{layer}.{_module_path(module)}.weight")

    def _rows(self, layer: int, module: str) -> tuple[int, int]:
        """This rank's output rows of `module` (all of them for a row-parallel one)."""
        part = self._source_slice(layer, module)
        if part is None or part[0] != 0:
            return 0, module_shape(self.cfg, module)[1]
        return part[1], part[2]

    def _fan_in(self, module: str) -> int:
        part = self._source_slice(0, module)
        if part is None or part[0] != 1:
            return module_shape(self.cfg, module)[0]
        return part[2] - part[1]

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copies the adapter into `slot` (whatever it held is overwritten; what the adapter does
        not target is zero)."""
        rank = adapter.config.rank
        for index, projections in enumerate(self.layers):
            for name, projection in projections.items():
                projection.lora_a[slot].zero_()
                projection.lora_b[slot].zero_()
                for sub, module in enumerate(PROJECTIONS[name]):
                    pair = adapter.weights.get((index, module))
                    if pair is None:
                        continue
                    a, b = pair
                    part = self._source_slice(index, module)
                    if part is not None and part[0] == 1:  # row-parallel: A's input columns
                        a = a[:, part[1] : part[2]]
                    elif part is not None:  # column-parallel: B's output rows
                        b = b[part[1] : part[2]]
                    lo, hi = projection.bounds[sub], projection.bounds[sub + 1]
                    projection.lora_a[slot, sub, :rank].copy_(a)
                    projection.lora_b[slot, lo:hi, :rank].copy_(b)
        self.slot_names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        self.slot_names[slot] = None


def _module_path(module: str) -> str:
    parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"{parent}.{module}"
