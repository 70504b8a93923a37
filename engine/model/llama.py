"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch and a paged
KV cache.

Parameter names follow HF's, except that q/k/v and gate/up are merged (qkv_proj, gate_up_proj): one
matmul each instead of three and two. The loader does the merging.

Under tensor parallelism (a TPGroup) each rank builds the same modules at its shard's sizes
(kvpilot.engine.parallel.sharding) and adds the three collectives: an all-reduce after o_proj, after
down_proj and after the vocab-parallel embedding, and a gather of the logits to rank 0. Without one
the model is the single-device model, with no collective and no extra op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

# Interfaces only: the backends and the kernels are chosen by name elsewhere and passed in.
from kvpilot.engine.attention.base import AttentionBackend, AttentionMetadata
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.model import layers
from kvpilot.engine.model.layer_ops import LayerOps
from kvpilot.engine.parallel.group import TPGroup
from kvpilot.engine.parallel.sharding import Shard


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the tokens; passed explicitly, never global."""

    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    kv_caches: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: [num_blocks, block_size, KVH, D] x2
    # Each token's LoRA adapter slot (engine/lora/ops.LoRAMapping; None: no token of the step
    # uses an adapter), read by LayerOps.add_lora.
    lora: Any = None
    # Per layer (k_scale, v_scale) of an FP8 cache (KVCachePool.scales); None: not quantized.
    kv_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None


class LoRAStacks(Protocol):
    """A projection's adapter weights in their slots (engine/lora/slots.LoRAProjection)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    bounds: tuple[int, ...]


def with_lora(
    ops: LayerOps, out: torch.Tensor, x: torch.Tensor, stacks: LoRAStacks | None, lora: Any
) -> torch.Tensor:
    """The projection's output `out` of input `x` plus each token's adapter delta (in place)."""
    if lora is not None and stacks is not None:
        if ops.add_lora is None:
            raise RuntimeError("a step maps tokens to adapters, but the model has no add_lora")
        ops.add_lora(out, x, stacks.lora_a, stacks.lora_b, stacks.bounds, lora)
    return out


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        shard: Shard,
        tp: TPGroup | None,
    ) -> None:
        super().__init__()
        self.num_heads = shard.num_heads
        self.num_kv_heads = shard.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        # Set by engine/lora/slots.py when the engine serves adapters.
        self.qkv_lora: LoRAStacks | None = None
        self.o_lora: LoRAStacks | None = None
        self.backend = backend
        self.ops = ops
        self.tp = tp

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = with_lora(self.ops, self.qkv_proj(x), x, self.qkv_lora, ctx.lora)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.ops.apply_rotary(q, k, ctx.positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
        self.backend.write_kv(
            k, v, k_cache, v_cache, ctx.attn.slot_mapping, k_scale=k_scale, v_scale=v_scale
        )
        out = self.backend.forward(
            q, k_cache, v_cache, ctx.attn, self.scale, k_scale=k_scale, v_scale=v_scale
        )
        out = out.reshape(num_tokens, self.q_size)
        out = with_lora(self.ops, self.o_proj(out), out, self.o_lora, ctx.lora)
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps, shard: Shard, tp: TPGroup | None) -> None:
        super().__init__()
        inter = shard.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False)
        self.gate_up_lora: LoRAStacks | None = None
        self.down_lora: LoRAStacks | None = None
        self.ops = ops
        self.tp = tp

    def forward(self, x: torch.Tensor, lora: Any = None) -> torch.Tensor:
        h = with_lora(self.ops, self.gate_up_proj(x), x, self.gate_up_lora, lora)
        # On CPU the projection may apply SiLU-and-multiply itself (cpu_linear.PackedSiluGateUp,
        # never used with adapters: their delta comes before the activation).
        if not getattr(self.gate_up_proj, "fuses_silu_and_mul", False):
            h = self.ops.silu_and_mul(h)
        out = with_lora(self.ops, self.down_proj(h), h, self.down_lora, lora)
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        shard: Shard,
        tp: TPGroup | None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend, ops, shard, tp)
        self.mlp = MLP(cfg, ops, shard, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        ctx: ForwardContext,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
        kv_scale: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        h, residual = self.ops.rms_norm(x, norm.weight, norm.eps, residual)
        h = self.self_attn(h, ctx, kv_cache, cos_sin_cache, kv_scale)
        norm = self.post_attention_layernorm
        h, residual = self.ops.rms_norm(h, norm.weight, norm.eps, residual)
        return self.mlp(h, ctx.lora), residual


class LlamaModel(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        ops: LayerOps,
        shard: Shard,
        tp: TPGroup | None,
    ) -> None:
        super().__init__()
        # Its storage given, not initialised: a random init of an Embedding on the meta device
        # (the loader builds there) imports torch's Python references and dynamo, seconds.
        self.embed_tokens = nn.Embedding(
            shard.vocab_per_rank,
            cfg.hidden_size,
            _weight=torch.empty(shard.vocab_per_rank, cfg.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, ops, shard, tp) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ops = ops


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        backend: AttentionBackend,
        max_positions: int,
        ops: LayerOps | None = None,
        tp: TPGroup | None = None,
        cos_sin_cache: torch.Tensor | None = None,
    ) -> None:
        """cos_sin_cache: the rotary table, built for max_positions (rope_cos_sin_cache) where the
        caller has it; else built here."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.shard = Shard(cfg) if tp is None else Shard(cfg, tp.rank, tp.size)
        ops = ops or LayerOps()
        self.model = LlamaModel(cfg, backend, ops, self.shard, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, self.shard.vocab_per_rank, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: it must stay float32 when the weights move to bf16/fp16.
        self.cos_sin_cache = (
            layers.rope_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
            if cos_sin_cache is None
            else cos_sin_cache
        )

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids: [T] -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids) if self.tp is None else self._embed_shard(input_ids)
        residual = None
        cos_sin = self.cos_sin_cache
        scales = ctx.kv_scales or [None] * len(ctx.kv_caches)
        for layer, kv_cache, kv_scale in zip(self.model.layers, ctx.kv_caches, scales, strict=True):
            h, residual = layer(h, residual, ctx, kv_cache, cos_sin, kv_scale)
        norm = self.model.norm
        h, _ = self.model.ops.rms_norm(h, norm.weight, norm.eps, residual)
        return h

    def _embed_shard(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: each rank embeds the ids in its rows, zeros elsewhere, summed."""
        local = input_ids - self.shard.vocab_start
        outside = (local < 0) | (local >= self.shard.vocab_per_rank)
        h = self.model.embed_tokens(local.masked_fill(outside, 0))
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        assert self.tp is not None
        return self.tp.all_reduce(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab] in float32 (sampling and logprobs want full precision); under
        tensor parallelism on rank 0 only (every rank must call it: it gathers), None elsewhere."""
        logits = self.lm_head(hidden).float()
        if self.tp is None:
            return logits
        return self.tp.gather_vocab(logits, self.config.vocab_size)
