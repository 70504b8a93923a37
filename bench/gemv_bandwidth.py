"""Batch-1 decode is a chain of matrix-vector products: how near the copy bandwidth do they run?

For each linear of the Llama-3.1-8B shape (bf16, one token), cuBLAS (torch's F.linear) and a plain
Triton GEMV (tile sweep) are timed inside a CUDA graph that walks through enough distinct weight
copies that nothing is served from the L2 (> 1 GB per replay), as a decode step walks through its
32 layers. Achieved bandwidth = weight bytes / time, against the device-to-device copy bandwidth
(bytes read + written) that gpu_offline_throughput.py's single-stream roofline divides by.

    python bench/gemv_bandwidth.py --out bench/out/gemv.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# name: (out_features, in_features) of the 8B shape; lm_head once per step.
SHAPES = {
    "qkv_proj": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up_proj": (28672, 4096),
    "down_proj": (4096, 14336),
    "lm_head": (128256, 4096),
}
TILES = [(n, k, w) for n in (4, 8, 16, 32) for k in (256, 512, 1024) for w in (4, 8)]


def gemv_kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv(
        x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
    ):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + cols).to(tl.float32)
            w = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=rows[:, None] < N)
            acc += w.to(tl.float32) * x[None, :]
        tl.store(out_ptr + rows, tl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=rows < N)

    return _gemv


def graph_ms(fn: Any, replays: int = 20) -> float:
    """Mean ms of one call of fn() captured in a CUDA graph (fn itself runs over every copy)."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def time_triton(
    gemv: Any, weights: list[Any], x: Any, out: Any, ref: Any, tile: tuple[int, int, int]
) -> tuple[float, float]:
    """(ms per weight copy, max abs error against cuBLAS on the first copy) of one tile."""
    import torch

    block_n, block_k, warps = tile
    n, k = weights[0].shape
    grid = (-(-n // block_n),)

    def run(copies: list[Any]) -> None:
        for w in copies:
            gemv[grid](x, w, out, n, k, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)

    run(weights[:1])
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    return graph_ms(lambda: run(weights)) / len(weights), err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/out/gemv.json"))
    args = p.parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_offline_throughput import measure_copy_bandwidth
    from kernels_bench import result_header

    gemv = gemv_kernel()
    copy_gb_s = measure_copy_bandwidth() / 1e9
    print(f"copy bandwidth {copy_gb_s:.0f} GB/s")
    rows: list[dict[str, Any]] = []
    for name, (n, k) in SHAPES.items():
        per_copy = n * k * 2
        copies = max(2, -(-(2**30) // per_copy))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0])

        def cublas(weights: list[Any] = weights, x: Any = x) -> None:
            for w in weights:
                F.linear(x, w)

        ms = graph_ms(cublas) / copies
        row: dict[str, Any] = {"linear": name, "shape": [n, k], "copies": copies}
        row["cublas_us"] = ms * 1e3
        row["cublas_gb_s"] = per_copy / ms / 1e6
        triton_rows = []
        for block_n, block_k, warps in TILES:
            t, err = time_triton(gemv, weights, x, out, ref, (block_n, block_k, warps))
            triton_rows.append(
                {"block_n": block_n, "block_k": block_k, "warps": warps, "us": t * 1e3, "err": err}
            )
        row["triton_best"] = min(triton_rows, key=lambda r: r["us"])
        row["triton_best"]["gb_s"] = per_copy / (row["triton_best"]["us"] / 1e3) / 1e6
        row["triton_tiles"] = triton_rows
        rows.append(row)
        tb = row["triton_best"]
        print(
            f"{name:13s} {n}x{k}: cublas {row['cublas_us']:7.1f} us {row['cublas_gb_s']:5.0f} GB/s"
            f" ({row['cublas_gb_s'] / copy_gb_s:.0%});  triton {tb['us']:7.1f} us"
            f" {tb['gb_s']:5.0f} GB/s ({tb['gb_s'] / copy_gb_s:.0%}) {tb['block_n']}x"
            f"{tb['block_k']} w{tb['warps']} err {tb['err']:.3g}",
            flush=True,
        )
        del weights
        torch.cuda.empty_cache()
    per_step_cublas = sum(r["cublas_us"] * (1 if r["linear"] == "lm_head" else 32) for r in rows)
    per_step_triton = sum(
        r["triton_best"]["us"] * (1 if r["linear"] == "lm_head" else 32) for r in rows
    )
    print(
        f"one decode step's linears: cublas {per_step_cublas:.0f} us, "
        f"best triton tile per shape {per_step_triton:.0f} us"
    )
    result = {
        **result_header("gemv_bandwidth.py"),
        "copy_gb_s": copy_gb_s,
        "rows": rows,
        "step_linears_us": {"cublas": per_step_cublas, "triton_best": per_step_triton},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
