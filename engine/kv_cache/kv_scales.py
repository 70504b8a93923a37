"""Where an FP8 KV cache's scales come from: the checkpoint where it has them, else a short
calibration pass at load, kept for the next start (scales_cache.py; kv_quant.py defines what a
scale means).

Checkpoint names, as vLLM reads them: `model.layers.N.self_attn.{k_scale,v_scale}`, the older
`...self_attn.kv_scale` (one for both) and `...self_attn.{k,v}_proj.output_scale`; a scalar
(per-tensor) or one value per KV head of the model.

Calibration: one forward of CALIBRATION_TOKENS fixed token ids (a seeded draw over the vocabulary,
the same on every rank and every start) through a full-precision scratch cache, then per layer
and KV head the largest |K| and |V| the pass wrote. Deterministic: same model, same scales. Per
head rather than per tensor because KV heads differ in range, and a head's values are quantized
on its own range rather than the widest head's. The scale leaves CALIBRATION_MARGIN times the
measured range below the format's largest value: inputs reach past what one pass saw, and e4m3's
relative precision is the same over its whole normal range (2^-6 .. 448), so headroom costs
nothing but the resolution of values ~1e4 times smaller than the largest, which attention
does not feel; past the range a value saturates (kv_quant.quantize clamps).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.kv_quant import KV_SCALE_NAME, fp8_max

if TYPE_CHECKING:
    from kvpilot.engine.model.llama import LlamaForCausalLM

log = logging.getLogger("kvpilot")

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 0
CALIBRATION_MARGIN = 4.0

KVScales = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_scale, v_scale), [KVH] float32


def read_checkpoint_scales(
    hf_dir: Path, num_layers: int, num_kv_heads: int, kv_head_start: int, total_kv_heads: int
) -> KVScales | None:
    """The checkpoint's scales for this rank's KV heads (kv_head_start.. of total_kv_heads), or
    None when it has none. ValueError when it has some layers' and not others', or a shape that
    is neither a scalar nor one value per KV head."""
    found: dict[tuple[int, str], torch.Tensor] = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                match = KV_SCALE_NAME.match(name)
                if match is None:
                    continue
                layer, kind = int(match.group(1)), match.group(2)
                value = f.get_tensor(name).float().reshape(-1)
                for which in ("k", "v") if kind == "kv_scale" else (kind[0],):
                    found[(layer, which)] = value
    if not found:
        return None
    scales: KVScales = []
    for layer in range(num_layers):
        pair = []
        for which in ("k", "v"):
            value = found.get((layer, which))
            if value is None:
                raise ValueError(f"{hf_dir}: the checkpoint has KV scales but none for layer "
                                 f"{layer}'s {which.upper()}")  # fmt: skip
            if value.numel() == 1:
                value = value.repeat(num_kv_heads)
            elif value.numel() == total_kv_heads:
                value = value[kv_head_start : kv_head_start + num_kv_heads]
            else:
                raise ValueError(
                    f"{hf_dir}: layer {layer}'s {which}_scale has {value.numel()} values; expected "
                    f"1 or one per KV head ({total_kv_heads})"
                )
            if not bool(torch.isfinite(value).all()) or bool((value <= 0).any()):
                raise ValueError(f"{hf_dir}: layer {layer}'s {which}_scale is not positive")
            pair.append(value.contiguous())
        scales.append((pair[0], pair[1]))
    return scales


@torch.inference_mode()
def calibrate_scales(
    model: LlamaForCausalLM,
    fp8_dtype: torch.dtype,
    model_dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    *,
    per_head: bool = True,
) -> KVScales:
    """Scales from one forward of the calibration tokens (module docstring); per_head=False gives
    per-tensor scales (one value repeated), the A/B of bench/fp8_kv_accuracy.py."""
    from kvpilot.engine.model.llama import ForwardContext

    n = min(CALIBRATION_TOKENS, len(model.cos_sin_cache))  # within the rotary table
    gen = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, model.config.vocab_size, (n,), generator=gen).to(device)
    num_blocks = -(-n // block_size)
    num_kv_heads, head_dim = model.shard.num_kv_heads, model.config.head_dim
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [
        (torch.zeros(shape, dtype=model_dtype, device=device),
         torch.zeros(shape, dtype=model_dtype, device=device))
        for _ in range(model.config.num_hidden_layers)
    ]  # fmt: skip

    def ints(values: list[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start_loc=ints([0, n], torch.int32),
        seq_lens=ints([n], torch.int32),
        block_tables=ints([list(range(num_blocks))], torch.int32),
        slot_mapping=torch.arange(n, dtype=torch.int64, device=device),
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=(n,),
        seq_lens_cpu=(n,),
    )
    model(input_ids, ForwardContext(torch.arange(n, device=device), meta, caches))
    limit = fp8_max(fp8_dtype)
    scales: KVScales = []
    for k_cache, v_cache in caches:
        pair = []
        for cache in (k_cache, v_cache):
            amax = cache.float().abs().amax(dim=(0, 1, 3))  # [KVH]
            if not per_head:
                amax = amax.max().expand(num_kv_heads)
            # An all-zero head (a pruned one) still needs a finite, positive scale.
            scale = (amax * CALIBRATION_MARGIN / limit).clamp_min(torch.finfo(torch.float32).tiny)
            pair.append(scale.contiguous())
        scales.append((pair[0], pair[1]))
    log.info(
        "FP8 KV scales calibrated on %d tokens: K %.3g..%.3g, V %.3g..%.3g",
        n,
        min(float(k.min()) for k, _ in scales),
        max(float(k.max()) for k, _ in scales),
        min(float(v.min()) for _, v in scales),
        max(float(v.max()) for _, v in scales),
    )
    return scales
