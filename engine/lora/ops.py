"""The batched LoRA delta of one projection for one step (Punica's shrink/expand; S-LoRA's
segmented batching): every token of the batch adds its own adapter's B(A x) to the projection's
output, in one call, whatever mix of adapters and base-model tokens the batch holds.

Layout (engine/lora/slots.py fills it):
- lora_a: [num_slots, num_sub, max_rank, in_features], one A per slot and sub-projection (the
  merged qkv projection has 3 subs: q, k, v; gate_up has 2; o and down have 1). An adapter of
  a lower rank is zero beyond its rank; a sub it does not target is all zero.
- lora_b: [num_slots, out_features, max_rank]: rows bounds[i]:bounds[i+1] belong to sub i, with
  the adapter's scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) already multiplied in.
- token_slots: [T] int64, each token's slot, -1 for the base model (no delta).

    out[t, bounds[i]:bounds[i+1]] += lora_b[s, bounds[i]:bounds[i+1]] @ (lora_a[s, i] @ x[t])

for every token t with slot s = token_slots[t] >= 0 and every sub i. add_lora_reference is that
definition, one token at a time in float64; the fast paths are tested against it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.cpu import lora as cpu_lora
from kvpilot.engine.cpu.build import load_library


@dataclass(frozen=True)
class LoRAMapping:
    """Which adapter slot each token of one step uses, built once per step and shared by every
    projection of every layer.

    token_slots: [T] int64 on the step's device (-1: base model).
    slot_rows: for each slot that has tokens in this step, (slot, the rows of its tokens as an
    int64 tensor on the device), in slot order; empty when no token uses an adapter.
    """

    token_slots: torch.Tensor
    slot_rows: tuple[tuple[int, torch.Tensor], ...]

    @property
    def has_adapters(self) -> bool:
        return bool(self.slot_rows)


def build_mapping(token_slots: Sequence[int], device: torch.device | str = "cpu") -> LoRAMapping:
    """The mapping from each token's slot (-1: none), on the host."""
    rows: dict[int, list[int]] = {}
    for row, slot in enumerate(token_slots):
        if slot >= 0:
            rows.setdefault(slot, []).append(row)
    return LoRAMapping(
        torch.tensor(list(token_slots), dtype=torch.int64, device=device),
        tuple(
            (slot, torch.tensor(rows[slot], dtype=torch.int64, device=device))
            for slot in sorted(rows)
        ),
    )


def add_lora_reference(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    token_slots: torch.Tensor,
) -> None:
    """The definition, token by token in float64, added to `out` in place (rounded once, to out's
    dtype, per element)."""
    delta = torch.zeros(out.shape, dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot < 0:
            continue
        for i in range(len(bounds) - 1):
            lo, hi = bounds[i], bounds[i + 1]
            h = lora_a[slot, i].double() @ x[t].double()
            delta[t, lo:hi] = lora_b[slot, lo:hi].double() @ h
    out.copy_((out.double() + delta.to(out.device)).to(out.dtype))


def add_lora_torch(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    mapping: LoRAMapping,
) -> None:
    """The segmented torch path (any device): per slot with tokens, one shrink over its rows and
    one expand per sub, added into `out` in place."""
    num_sub, rank = lora_a.shape[1], lora_a.shape[2]
    for slot, rows in mapping.slot_rows:
        xs = x.index_select(0, rows)
        h = xs @ lora_a[slot].reshape(num_sub * rank, -1).t()  # [rows, num_sub * rank]
        delta = torch.empty((len(rows), out.shape[1]), dtype=out.dtype, device=out.device)
        for i in range(num_sub):
            lo, hi = bounds[i], bounds[i + 1]
            torch.matmul(
                h[:, i * rank : (i + 1) * rank], lora_b[slot, lo:hi].t(), out=delta[:, lo:hi]
            )
        out.index_add_(0, rows, delta)


def add_lora(
    out: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    bounds: Sequence[int],
    mapping: LoRAMapping,
) -> None:
    """Adds every token's adapter delta to `out` in place (the module docstring's definition):
    x [T, K], out [T, N], lora_a [num_slots, num_sub, max_rank, K], lora_b [num_slots, N,
    max_rank], bounds the subs' first rows in N and N itself. CPU tensors the C kernel takes go to
    it (kvpilot.engine.cpu.lora), CUDA tensors to the Triton kernel (kvpilot.engine.kernels.lora),
    anything else (or a machine without a C compiler) to add_lora_torch. A batch without adapter
    tokens leaves `out` untouched."""
    if not mapping.has_adapters:
        return
    if out.is_cuda:
        from kvpilot.engine.kernels.runtime import has_triton

        if has_triton():  # lazy: the kernels' module imports Triton, which a CPU install may lack
            from kvpilot.engine.kernels.lora import add_lora_triton, triton_takes

            if triton_takes(out, x, lora_a, lora_b, bounds, mapping.token_slots):
                add_lora_triton(out, x, lora_a, lora_b, bounds, mapping.token_slots)
                return
    elif out.is_cpu:
        lib = load_library()
        if lib is not None and cpu_lora.add_lora(
            lib, out, x, lora_a, lora_b, bounds, mapping.token_slots
        ):
            return
    add_lora_torch(out, x, lora_a, lora_b, bounds, mapping)
