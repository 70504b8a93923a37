"""The CPU elementwise steps, torch vs the C kernels, side by side: RMSNorm (with a residual),
rotary and SiLU-and-multiply, at SmolLM2's widths and 32 / 256 / 2048 rows (a decode batch, a
small and a full prefill step), in float32 and bfloat16. Microseconds per call, best of 3 loops.

`--mlp`: the whole MLP block instead (packed gate_up, SiLU-and-multiply, packed down_proj), three
ways, in turn, many rounds, best and median per call: torch's silu_and_mul between the packed
linears, the C kernel between them, and oneDNN post-ops (gate with a fused swish, up with a fused
multiply by it, so the [rows, 2 * inter] intermediate never exists); plus down_proj with and
without a fused residual add. An op alone runs on inputs hot in cache; inside the block it reads
what the linear just wrote and allocates as the model does.

    python bench/cpu_layer_ops_bench.py
    python bench/cpu_layer_ops_bench.py --mlp --rows 32,64,2048 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvpilot.engine.config import RopeScaling
from kvpilot.engine.cpu import layer_ops
from kvpilot.engine.cpu.build import load_library
from kvpilot.engine.model import layers

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, INTER = 576, 9, 3, 64, 1536
linear = torch.ops.mkldnn._linear_pointwise


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    for _ in range(10):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def cases(lib: object, rows: int, dtype: torch.dtype) -> dict[str, tuple[Callable, Callable]]:
    """op name -> (torch call, C call) on the same inputs."""
    cache = layers.rope_cos_sin_cache(HEAD_DIM, 8192, 10000.0, RopeScaling())
    x = torch.randn(rows, HIDDEN).to(dtype)
    residual = torch.randn(rows, HIDDEN).to(dtype)
    weight = torch.randn(HIDDEN).to(dtype)
    q = torch.randn(rows, NUM_HEADS, HEAD_DIM).to(dtype)
    k = torch.randn(rows, NUM_KV_HEADS, HEAD_DIM).to(dtype)
    positions = torch.randint(0, 8192, (rows,))
    gate_up = (3 * torch.randn(rows, 2 * INTER)).to(dtype)
    return {
        "rms_norm": (
            lambda: layers.rms_norm(x, weight, 1e-5, residual),
            lambda: layer_ops.rms_norm(lib, x, weight, 1e-5, residual),
        ),
        "rotary": (
            lambda: layers.apply_rotary(q, k, positions, cache),
            lambda: layer_ops.apply_rotary(lib, q, k, positions, cache),
        ),
        "silu_mul": (
            lambda: layers.silu_and_mul(gate_up),
            lambda: layer_ops.silu_and_mul(lib, gate_up),
        ),
    }


def mlp_cases(lib: object, rows: int, dtype: torch.dtype) -> dict[str, Callable[[], object]]:
    """variant -> the MLP block (or one step of it) on the same inputs, weights packed for rows."""
    gen = torch.Generator().manual_seed(0)
    gate_up_w = (0.05 * torch.randn(2 * INTER, HIDDEN, generator=gen)).to(dtype)
    down_w = (0.05 * torch.randn(HIDDEN, INTER, generator=gen)).to(dtype)
    x = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    h = torch.randn(rows, INTER, generator=gen).to(dtype)
    residual = torch.randn(rows, HIDDEN, generator=gen).to(dtype)

    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows)

    gate_up, gate, up, down = (
        pack(gate_up_w),
        pack(gate_up_w[:INTER]),
        pack(gate_up_w[INTER:]),
        pack(down_w),
    )

    def fused_gate_up() -> torch.Tensor:
        silu_gate = linear(x, gate, None, "swish", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, silu_gate, up, None, "mul")

    return {
        "torch": lambda: linear(
            layers.silu_and_mul(linear(x, gate_up, None, "none", [], "")),
            down,
            None,
            "none",
            [],
            "",
        ),
        "C": lambda: linear(
            layer_ops.silu_and_mul(lib, linear(x, gate_up, None, "none", [], "")),
            down,
            None,
            "none",
            [],
            "",
        ),
        "oneDNN": lambda: linear(fused_gate_up(), down, None, "none", [], ""),
        "gate_up alone": lambda: linear(x, gate_up, None, "none", [], ""),
        "down + add": lambda: linear(h, down, None, "none", [], "") + residual,
        "down, add fused": lambda: torch.ops.mkldnn._linear_pointwise.binary(
            h, residual, down, None, "add"
        ),
    }


def run_mlp(lib: object, rows_list: list[int], rounds: int) -> None:
    """Variants in turn within each round, so a busy machine slows them alike; best and median."""
    print(f"{'dtype':>9} {'rows':>5} {'variant':>16} {'best us':>9} {'median us':>10}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in rows_list:
            variants = mlp_cases(lib, rows, dtype)
            calls = max(2, 20000 // rows)
            times: dict[str, list[float]] = {name: [] for name in variants}
            for _ in range(rounds):
                for name, fn in variants.items():
                    fn()
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn()
                    times[name].append((time.perf_counter() - start) / calls * 1e6)
            for name, samples in times.items():
                print(
                    f"{str(dtype).removeprefix('torch.'):>9} {rows:>5} {name:>16} "
                    f"{min(samples):>9.1f} {statistics.median(samples):>10.1f}"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mlp", action="store_true", help="the MLP block three ways (see above)")
    ap.add_argument("--rows", default="32,64,2048", help="--mlp: comma-separated row counts")
    ap.add_argument("--rounds", type=int, default=9, help="--mlp: rounds of every variant")
    args = ap.parse_args()
    lib = load_library()
    if lib is None:
        raise SystemExit("no C compiler: the CPU kernels could not be built")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.mlp:
        run_mlp(lib, [int(r) for r in args.rows.split(",")], args.rounds)
        return
    print(f"{'op':>9} {'dtype':>9} {'rows':>5} {'torch us':>10} {'C us':>8} {'speed-up':>9}")
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (32, 256, 2048):
            calls = 2000 if rows < 1000 else 200
            for name, (torch_fn, c_fn) in cases(lib, rows, dtype).items():
                t_torch, t_c = per_call_us(torch_fn, calls), per_call_us(c_fn, calls)
                print(
                    f"{name:>9} {str(dtype).removeprefix('torch.'):>9} {rows:>5} "
                    f"{t_torch:>10.1f} {t_c:>8.1f} {t_torch / t_c:>8.2f}x"
                )


if __name__ == "__main__":
    main()
