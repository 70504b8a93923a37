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
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

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
