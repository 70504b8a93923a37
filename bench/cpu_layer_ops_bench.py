"""The CPU elementwise steps, torch vs the C kernels, side by side: RMSNorm (with a residual) and
rotary, at SmolLM2's widths and 32 / 256 / 2048 rows (a decode batch, a small and a full prefill
step), in float32 and bfloat16. Microseconds per call, best of 3 loops.

    python bench/cpu_layer_ops_bench.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvpilot.engine.config import RopeScaling
from kvpilot.engine.cpu import layer_ops
from kvpilot.engine.cpu.build import load_library
from kvpilot.engine.model import layers

HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 576, 9, 3, 64


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
    return {
        "rms_norm": (
            lambda: layers.rms_norm(x, weight, 1e-5, residual),
            lambda: layer_ops.rms_norm(lib, x, weight, 1e-5, residual),
        ),
        "rotary": (
            lambda: layers.apply_rotary(q, k, positions, cache),
            lambda: layer_ops.apply_rotary(lib, q, k, positions, cache),
        ),
    }


def main() -> None:
    lib = load_library()
    if lib is None:
        raise SystemExit("no C compiler: the CPU kernels could not be built")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
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
