"""Kernel micro-benchmarks on a CUDA GPU, at the Llama-3.1-8B shape (32 query / 8 KV heads,
head_dim 128, hidden 4096, intermediate 14336), bf16.

- attention, per layer: the Triton paged kernel (auto split-K, and split-K off) against torch
  SDPA on the same keys already gathered into a dense [B, KVH, L, D] tensor (the best a non-paged
  torch path can do), and against the engine's torch fallback (gather + SDPA); achieved bandwidth
  = KV bytes read (+ query and output) / time; for prefill chunks also TFLOP/s.
- the KV write, RMSNorm(+residual), SiLU-and-mul and rotary: fused kernel against the torch ops;
  achieved bandwidth = bytes the op must move / time.
- --sweep: the attention tile size (keys per iteration) and split counts, to tune the defaults.

Timing: triton.testing.do_bench (median of repeated runs, L2 flushed between them).

    python bench/kernels_bench.py --out bench/out/kernels.json [--sweep] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 32, 8, 128, 4096, 14336
BLOCK_SIZE = 16


def bench_ms(fn: Callable[[], Any]) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def result_header(script: str) -> dict[str, Any]:
    """The device, versions and command every GPU benchmark's JSON starts with."""
    import torch
    import triton

    return {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
    }


def paged_batch(seqs: list[tuple[int, int]], dtype: Any, seed: int = 0) -> dict[str, Any]:
    """(prefix, query length) per sequence -> query, caches and AttentionMetadata on the GPU, with
    blocks handed out shuffled (a realistic, fragmented pool)."""
    import torch

    from kvpilot.engine.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for _, q in seqs]
    seq_lens = [p + q for p, q in seqs]
    nblocks = [-(-s // BLOCK_SIZE) for s in seq_lens]
    total = sum(nblocks)
    perm = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(seqs), max(nblocks), dtype=torch.int32)
    offset = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[offset : offset + n].int()
        offset += n
    dev = "cuda"
    shape = (total, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device=dev, dtype=dtype)
    v_cache = torch.randn(shape, device=dev, dtype=dtype)
    query = torch.randn(sum(q_lens), HEADS, HEAD_DIM, device=dev, dtype=dtype)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=dev),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(q_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return {"query": query, "k_cache": k_cache, "v_cache": v_cache, "meta": meta}


def attention_case(
    name: str, seqs: list[tuple[int, int]], dtype: Any, sweep: bool
) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from kvpilot.engine.attention.torch_ref import gather_kv, paged_attention_reference
    from kvpilot.engine.kernels.attention import paged_attention

    b = paged_batch(seqs, dtype)
    q, kc, vc, meta = b["query"], b["k_cache"], b["v_cache"], b["meta"]
    scale = 1 / math.sqrt(HEAD_DIM)
    itemsize = q.element_size()
    kv_bytes = sum(meta.seq_lens_cpu) * KV_HEADS * HEAD_DIM * 2 * itemsize
    moved = kv_bytes + 2 * q.numel() * itemsize
    # Causal FLOPs: 4 * D per (query, visible key) pair, per head.
    pairs = 0
    for seq_len, q_len in zip(meta.seq_lens_cpu, meta.query_lens_cpu, strict=True):
        pairs += q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2
    flops = 4 * HEAD_DIM * HEADS * pairs
    rows: list[dict[str, Any]] = []

    def record(impl: str, ms: float, **extra: Any) -> None:
        rows.append(
            {
                "bench": "attention",
                "case": name,
                "impl": impl,
                "ms": ms,
                "gb_s": moved / ms / 1e6,
                "tflop_s": flops / ms / 1e9,
                **extra,
            }
        )

    record("triton", bench_ms(lambda: paged_attention(q, kc, vc, meta, scale)))
    record(
        "triton-no-split", bench_ms(lambda: paged_attention(q, kc, vc, meta, scale, num_splits=1))
    )
    if sweep:
        for tile_n in (16, 32, 64, 128):
            for splits in (1, 2, 4, 8, 16):
                ms = bench_ms(
                    lambda t=tile_n, s=splits: paged_attention(
                        q, kc, vc, meta, scale, num_splits=s, tile_n=t
                    )
                )
                record("triton-sweep", ms, tile_n=tile_n, num_splits=splits)
    # torch SDPA on keys already dense: equal-length decode batches or a single sequence only.
    if len(set(meta.seq_lens_cpu)) == 1 and len(set(meta.query_lens_cpu)) == 1:
        n, ql, sl = meta.num_seqs, meta.query_lens_cpu[0], meta.seq_lens_cpu[0]
        dense_k = torch.stack([gather_kv(kc, meta.block_tables[i], sl) for i in range(n)])
        dense_v = torch.stack([gather_kv(vc, meta.block_tables[i], sl) for i in range(n)])
        dense_k = dense_k.transpose(1, 2).contiguous()  # [B, KVH, L, D]
        dense_v = dense_v.transpose(1, 2).contiguous()
        dq = q.view(n, ql, HEADS, HEAD_DIM).transpose(1, 2).contiguous()
        mask = None
        if ql > 1:
            pos_q = torch.arange(sl - ql, sl, device="cuda")[:, None]
            mask = torch.arange(sl, device="cuda")[None, :] <= pos_q

        def dense() -> Any:
            return F.scaled_dot_product_attention(
                dq, dense_k, dense_v, attn_mask=mask, scale=scale, enable_gqa=True
            )

        record("torch-sdpa-dense-kv", bench_ms(dense))
        del dense_k, dense_v
    record(
        "torch-ref-gather-sdpa",
        bench_ms(lambda: paged_attention_reference(q, kc, vc, meta, scale)),
    )
    return rows


def attention_cases(quick: bool) -> list[tuple[str, list[tuple[int, int]]]]:
    cases = []
    for batch in (1, 16, 64, 256) if not quick else (1, 64):
        for context in (512, 2048, 8192, 32768) if not quick else (2048,):
            if batch * context > 256 * 8192:
                continue
            cases.append((f"decode b={batch} ctx={context}", [(context - 1, 1)] * batch))
    cases.append(("prefill 2048", [(0, 2048)]))
    cases.append(("chunk 512 after 4096", [(4096, 512)]))
    cases.append(("mixed: chunk 1024 + 128 decodes at 1024", [(0, 1024)] + [(1023, 1)] * 128))
    return cases


def layer_op_rows(quick: bool) -> list[dict[str, Any]]:
    import torch

    from kvpilot.engine.config import RopeScaling
    from kvpilot.engine.model import layers

    cache = layers.rope_cos_sin_cache(
        HEAD_DIM, 8192, 500000.0, RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    ).cuda()
    rows: list[dict[str, Any]] = []
    for tokens in (1, 64, 256, 2048) if not quick else (256,):
        rows += layer_op_rows_at(tokens, cache, torch.bfloat16)
    return rows


def layer_op_rows_at(tokens: int, cache: Any, dtype: Any) -> list[dict[str, Any]]:
    import torch

    from kvpilot.engine.attention.torch_ref import write_kv_reference
    from kvpilot.engine.kernels import activation, kv_cache, rms_norm, rotary
    from kvpilot.engine.model import layers

    es = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=dtype)
    res = torch.randn_like(x)
    w = torch.ones(HIDDEN, device="cuda", dtype=dtype)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device="cuda", dtype=dtype)
    qkv = torch.randn(tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    q, k, v = qkv[:, :HEADS], qkv[:, HEADS : HEADS + KV_HEADS], qkv[:, HEADS + KV_HEADS :]
    pos = torch.randint(0, cache.shape[0], (tokens,), device="cuda")
    k_cache = torch.zeros(4096, BLOCK_SIZE, KV_HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(4096 * BLOCK_SIZE, device="cuda")[:tokens]
    ops: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
        # name: (fused, torch, bytes the op must move)
        "rms_norm+residual": (
            lambda: rms_norm.rms_norm(x, w, 1e-5, res),
            lambda: layers.rms_norm(x, w, 1e-5, res),
            4 * x.numel() * es,
        ),
        "silu_and_mul": (
            lambda: activation.silu_and_mul(gate_up),
            lambda: layers.silu_and_mul(gate_up),
            3 * gate_up.numel() // 2 * es,
        ),
        "rotary": (
            lambda: rotary.apply_rotary(q, k, pos, cache),
            lambda: layers.apply_rotary(q, k, pos, cache),
            2 * (q.numel() + k.numel()) * es,
        ),
        "write_kv": (
            lambda: kv_cache.write_kv(k, v, k_cache, v_cache, slots),
            lambda: write_kv_reference(k, v, k_cache, v_cache, slots),
            4 * k.numel() * es,
        ),
    }
    rows = []
    for name, (fused, ref, nbytes) in ops.items():
        for impl, fn in (("triton", fused), ("torch", ref)):
            ms = bench_ms(fn)
            rows.append(
                {
                    "bench": name,
                    "case": f"tokens={tokens}",
                    "impl": impl,
                    "ms": ms,
                    "gb_s": nbytes / ms / 1e6,
                }
            )
    return rows


def to_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| bench | case | impl | ms | GB/s | TFLOP/s | config |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        config = " ".join(f"{k}={r[k]}" for k in ("tile_n", "num_splits") if k in r)
        tflops = f"{r['tflop_s']:.1f}" if "tflop_s" in r else ""
        lines.append(
            f"| {r['bench']} | {r['case']} | {r['impl']} | {r['ms']:.4f} | {r['gb_s']:.0f} "
            f"| {tflops} | {config} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/out/kernels.json"))
    p.add_argument("--sweep", action="store_true", help="also sweep attention tile sizes / splits")
    p.add_argument("--quick", action="store_true", help="a few cases only")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2

    rows: list[dict[str, Any]] = []
    for name, seqs in attention_cases(args.quick):
        rows += attention_case(name, seqs, torch.bfloat16, args.sweep)
        print(to_markdown(rows[-1:]).splitlines()[-1], flush=True)
    rows += layer_op_rows(args.quick)
    result = {**result_header("kernels_bench.py"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(to_markdown(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
