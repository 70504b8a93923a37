"""SmolLM2's decoder linears at decode batch sizes, weights from DRAM: how close each CPU GEMM
path comes to the memory's read bandwidth.

A decode step with few sequences multiplies M = batch rows by every weight once, so its linears
are bound by reading the weights. This holds 30 layers' four linears (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; 212 MB in bfloat16, 424 MB in float32: far more than L3, as in
the model) and runs them in order, timing the whole pass, through: oneDNN's packed linear (the
engine's PackedLinear; weight packed for a batch hint of 64, and of M), plain `F.linear`, and in
float32 MKL's packed sgemm. It also reads a tensor of the same size (`sum`): the bandwidth a
weight-bound kernel could reach.

    python bench/cpu_small_m_linears.py --dtype float32 --rows 16

In float32 it also times PROTOTYPE, a first small-M kernel (not the engine's: built here with
`cc`, weights packed [N/16][K][16], 8 rows x 3 column blocks of accumulators), after checking it
against `F.linear`: what a kernel of kvpilot's own could start from.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
Linear = Callable[[torch.Tensor], torch.Tensor]


def pass_seconds(layers: list[dict[str, Linear]], inputs: dict[str, torch.Tensor]) -> float:
    """Median wall time of one pass over every layer's linears (2 unmeasured passes first)."""
    times = []
    for _ in range(7):
        start = time.perf_counter()
        for layer in layers:
            for name, linear in layer.items():
                linear(inputs[name])
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def onednn(weight: torch.Tensor, hint: int) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def mkl(weight: torch.Tensor, rows: int) -> Linear:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)


PROTOTYPE = r"""
#include <immintrin.h>
#include <stdint.h>
/* y[M][N] = x[M][K] W^T, M <= 16, W packed [N/16][K][16]: 8 rows x 3 column blocks at a time. */
void small_m_f32(const float *x, const float *wp, float *y, int64_t M, int64_t N, int64_t K) {
    const int64_t nb = N / 16, groups = (nb + 2) / 3;
    #pragma omp parallel for schedule(static) collapse(2)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t m0 = 0; m0 < 16; m0 += 8) {
            if (m0 >= M) continue;
            const int64_t b0 = g * 3, nblk = nb - b0 < 3 ? nb - b0 : 3;
            __m512 acc[8][3];
            for (int r = 0; r < 8; r++)
                for (int c = 0; c < 3; c++) acc[r][c] = _mm512_setzero_ps();
            const float *w0 = wp + b0 * K * 16, *w1 = w0 + K * 16, *w2 = w1 + K * 16;
            for (int64_t k = 0; k < K; k++) {
                const __m512 a = _mm512_loadu_ps(w0 + k * 16);
                const __m512 b = nblk > 1 ? _mm512_loadu_ps(w1 + k * 16) : a;
                const __m512 c = nblk > 2 ? _mm512_loadu_ps(w2 + k * 16) : a;
                for (int r = 0; r < 8; r++) {
                    const __m512 xv = _mm512_set1_ps(x[(m0 + r < M ? m0 + r : 0) * K + k]);
                    acc[r][0] = _mm512_fmadd_ps(xv, a, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(xv, b, acc[r][1]);
                    acc[r][2] = _mm512_fmadd_ps(xv, c, acc[r][2]);
                }
            }
            for (int r = 0; r < 8 && m0 + r < M; r++)
                for (int c = 0; c < nblk; c++)
                    _mm512_storeu_ps(y + (m0 + r) * N + (b0 + c) * 16, acc[r][c]);
        }
}
"""


def prototype(rows: int) -> Callable[[torch.Tensor], Linear] | None:
    """PROTOTYPE built with cc for this CPU, as a maker of linears; None where it cannot build."""
    workdir = Path(tempfile.mkdtemp())
    (workdir / "small_m.c").write_text(PROTOTYPE)
    built = subprocess.run(
        ["cc", "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "small_m.c", "-o", "lib.so"],
        cwd=workdir,
        capture_output=True,
    )
    if built.returncode != 0:
        return None
    kernel = ctypes.CDLL(str(workdir / "lib.so")).small_m_f32
    kernel.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3

    def make(weight: torch.Tensor) -> Linear:
        n, k = weight.shape
        packed = weight.view(n // 16, 16, k).transpose(1, 2).contiguous()
        out = torch.empty(rows, n)

        def linear(x: torch.Tensor) -> torch.Tensor:
            kernel(x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, n, k)
            return out

        return linear

    return make


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", type=int, default=16, help="M: sequences in the decode step")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(0)
    weights = [
        {
            name: (torch.randn(shape, generator=gen) * 0.02).to(dtype)
            for name, shape in SHAPES.items()
        }
        for _ in range(LAYERS)
    ]
    inputs = {
        name: torch.randn(args.rows, k, generator=gen).to(dtype) for name, (_, k) in SHAPES.items()
    }
    paths: dict[str, Callable[[torch.Tensor], Linear]] = {
        "oneDNN packed, hint 64": lambda w: onednn(w, 64),
        f"oneDNN packed, hint {args.rows}": lambda w: onednn(w, args.rows),
        "F.linear": lambda w: lambda x: F.linear(x, w),
    }
    if dtype == torch.float32 and hasattr(torch.ops.mkl, "_mkl_linear"):
        paths["MKL packed sgemm"] = lambda w: mkl(w, args.rows)
    small_m = prototype(args.rows) if dtype == torch.float32 and args.rows <= 16 else None
    if small_m is not None:
        for name, x in inputs.items():
            w = weights[0][name]
            error = float((small_m(w)(x) - F.linear(x, w)).abs().max())
            assert error < 1e-4, f"the prototype is wrong on {name}: {error}"
        paths["C prototype"] = small_m
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer.values())
    flat = torch.randn(nbytes // 4)
    flat.sum()
    start = time.perf_counter()
    for _ in range(5):
        flat.sum()
    read = nbytes / ((time.perf_counter() - start) / 5) / 1e9
    threads = torch.get_num_threads()
    print(f"{args.dtype}, M={args.rows}, {nbytes / 1e6:.0f} MB of weights, {threads} threads; "
          f"reading as many bytes (sum): {read:.1f} GB/s")  # fmt: skip
    for label, make in paths.items():
        layers = [{name: make(w) for name, w in layer.items()} for layer in weights]
        seconds = pass_seconds(layers, inputs)
        print(f"  {label:24s} {seconds * 1e3:6.2f} ms per pass, "
              f"{nbytes / seconds / 1e9:5.1f} GB/s of weights")  # fmt: skip


if __name__ == "__main__":
    main()
