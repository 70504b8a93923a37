"""SmolLM2's decoder linears at decode batch sizes, weights from DRAM: how close each CPU GEMM
path comes to the memory's read bandwidth.

A decode step with few sequences multiplies M = batch rows by every weight once, so its linears
are bound by reading the weights. This holds 30 layers' four linears (qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536; 212 MB in bfloat16, 424 MB in float32: far more than L3, as in
the model) and runs them in order, timing the whole pass, through: kvpilot's own kernel
(engine/cpu/linear.py; every path is checked against `F.linear` first), oneDNN's packed linear
(PackedLinear, the engine's before it; weight packed for a batch hint of 64, and of M), plain
`F.linear`, and in float32 MKL's packed sgemm. It also reads a tensor of the same size (`sum`):
the bandwidth a weight-bound kernel could reach.

    python bench/cpu_small_m_linears.py --dtype float32 --rows 1,8,16,64,512

The largest row counts are prefill's, where the pass is compute-bound: the figure to read there is
the GFLOP/s. --skip-slow leaves out F.linear and MKL (far behind at every size).
--variant-flags adds kvpilot's kernel built with extra compiler flags (an A/B of a change kept
behind a macro while it is measured).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
Linear = Callable[[torch.Tensor], torch.Tensor]


def pass_seconds(
    paths: dict[str, list[dict[str, Linear]]], inputs: dict[str, torch.Tensor], repeats: int
) -> dict[str, float]:
    """Each path's median wall time of one pass over every layer's linears, the paths taking
    turns pass by pass (so a drift in the machine's speed reaches all of them alike); the first
    round is unmeasured."""
    times: dict[str, list[float]] = {label: [] for label in paths}
    for _ in range(repeats):
        for label, layers in paths.items():
            start = time.perf_counter()
            for layer in layers:
                for name, linear in layer.items():
                    linear(inputs[name])
            times[label].append(time.perf_counter() - start)
    return {label: statistics.median(t[1:]) for label, t in times.items()}


def onednn(weight: torch.Tensor, hint: int) -> Linear:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def mkl(weight: torch.Tensor, rows: int) -> Linear:
    packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
    return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)


def kernel(weight: torch.Tensor, flags: tuple[str, ...] = ()) -> Linear | None:
    """The engine's own linear (engine/cpu/linear.py), its library built with `flags` added, None
    where this CPU or build lacks it."""
    from kvpilot.engine.cpu.build import load_library
    from kvpilot.engine.cpu.linear import KernelLinear, kernel_available

    lib = load_library(flags)
    if not kernel_available(lib, weight.dtype):
        return None
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    linear.weight.data = weight
    return KernelLinear(lib, linear)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rows", default="16", help="M, comma-separated: sequences in the step")
    ap.add_argument("--skip-slow", action="store_true", help="only kvpilot's kernel and oneDNN")
    ap.add_argument(
        "--variant-flags",
        default="",
        help="also kvpilot's kernel built with these compiler flags (an A/B of a kernel change)",
    )
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
    nbytes = sum(w.numel() * w.element_size() for layer in weights for w in layer.values())
    flops_per_row = 2 * sum(w.numel() for layer in weights for w in layer.values())
    flat = torch.randn(nbytes // 4)
    flat.sum()
    start = time.perf_counter()
    for _ in range(5):
        flat.sum()
    read = nbytes / ((time.perf_counter() - start) / 5) / 1e9
    print(f"{args.dtype}, {nbytes / 1e6:.0f} MB of weights, {torch.get_num_threads()} threads; "
          f"reading as many bytes (sum): {read:.1f} GB/s")  # fmt: skip
    for rows in map(int, args.rows.split(",")):
        inputs = {
            name: torch.randn(rows, k, generator=gen).to(dtype) for name, (_, k) in SHAPES.items()
        }
        paths: dict[str, Callable[[torch.Tensor], Linear | None]] = {
            "kvpilot kernel": kernel,
            "oneDNN packed, hint 64": lambda w: onednn(w, 64),
            f"oneDNN packed, hint {rows}": lambda w, rows=rows: onednn(w, rows),
        }
        if args.variant_flags:
            paths[f"kernel {args.variant_flags}"] = functools.partial(
                kernel, flags=tuple(args.variant_flags.split())
            )
        if not args.skip_slow:
            paths["F.linear"] = lambda w: functools.partial(F.linear, weight=w)
            if dtype == torch.float32 and hasattr(torch.ops.mkl, "_mkl_linear"):
                paths["MKL packed sgemm"] = lambda w, rows=rows: mkl(w, rows)
        print(f"  M={rows}")
        built: dict[str, list[dict[str, Linear]]] = {}
        for label, make in paths.items():
            layers = [{name: make(w) for name, w in layer.items()} for layer in weights]
            if any(linear is None for layer in layers for linear in layer.values()):
                print(f"    {label:24s} not on this CPU / build")
                continue
            for name, x in inputs.items():
                expected = F.linear(x.float(), weights[0][name].float())
                error = float((layers[0][name](x).float() - expected).abs().max())
                bound = 1e-3 if dtype == torch.float32 else 0.05 * float(expected.abs().max())
                assert error < bound, f"{label} is wrong on {name}: {error}"
            built[label] = layers  # type: ignore[assignment]
        timed = pass_seconds(built, inputs, repeats=9 if rows <= 64 else 4)
        for label, seconds in timed.items():
            print(f"    {label:24s} {seconds * 1e3:8.2f} ms per pass, "
                  f"{nbytes / seconds / 1e9:5.1f} GB/s of weights, "
                  f"{rows * flops_per_row / seconds / 1e9:6.1f} GFLOP/s")  # fmt: skip


if __name__ == "__main__":
    main()
