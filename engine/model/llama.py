"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a flat token batch and a paged
KV cache.

Parameter names follow HF's, except that q/k/v and gate/up are merged (qkv_proj, gate_up_proj): one
matmul each instead of three and two. The loader does the merging.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Interfaces only: the backends and the kernels are chosen by name elsewhere and passed in.
from kvpilot.engine.attention.base import AttentionBackend, AttentionMetadata
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.model import layers
from kvpilot.engine.model.layer_ops import LayerOps


@dataclass
class ForwardContext:
    """Everything one forward pass needs besides the tokens; passed explicitly, never global."""

    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    kv_caches: list[
        tuple[torch.Tensor, torch.Tensor]
    ]  # per layer: [num_blocks, block_size, KVH, D] x2


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5
        self.backend = backend
        self.ops = ops

    def forward(
        self,
        x: torch.Tensor,
        ctx: ForwardContext,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.ops.apply_rotary(q, k, ctx.positions, cos_sin_cache)
        k_cache, v_cache = kv_cache
        self.backend.write_kv(k, v, k_cache, v_cache, ctx.attn.slot_mapping)
        out = self.backend.forward(q, k_cache, v_cache, ctx.attn, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: LayerOps) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, backend, ops)
        self.mlp = MLP(cfg, ops)
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
    ) -> tuple[torch.Tensor, torch.Tensor]:
        norm = self.input_layernorm
        h, residual = self.ops.rms_norm(x, norm.weight, norm.eps, residual)
        h = self.self_attn(h, ctx, kv_cache, cos_sin_cache)
        norm = self.post_attention_layernorm
        h, residual = self.ops.rms_norm(h, norm.weight, norm.eps, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, ops: LayerOps) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, backend, ops) for _ in range(cfg.num_hidden_layers)
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
    ) -> None:
        super().__init__()
        self.config = cfg
        ops = ops or LayerOps()
        self.model = LlamaModel(cfg, backend, ops)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # A plain attribute, not a buffer: it must stay float32 when the weights move to bf16/fp16.
        self.cos_sin_cache = layers.rope_cos_sin_cache(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids: [T] -> final hidden states [T, hidden]."""
        h = self.model.embed_tokens(input_ids)
        residual = None
        cos_sin = self.cos_sin_cache
        for layer, kv_cache in zip(self.model.layers, ctx.kv_caches, strict=True):
            h, residual = layer(h, residual, ctx, kv_cache, cos_sin)
        norm = self.model.norm
        h, _ = self.model.ops.rms_norm(h, norm.weight, norm.eps, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[S, hidden] -> [S, vocab] in float32 (sampling and logprobs want full precision)."""
        return self.lm_head(hidden).float()
