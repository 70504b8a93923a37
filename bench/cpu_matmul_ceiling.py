"""The CPU's matmul ceiling for SmolLM2's shapes, float32 vs bfloat16.

What any engine on this machine can reach at a given batch: GFLOP/s for [M x 576] . [576 x 3072]
(the gate/up projection).

    python bench/cpu_matmul_ceiling.py
"""

from __future__ import annotations

import time

import torch


def gflops(m: int, dtype: torch.dtype, repeats: int = 100) -> float:
    x = torch.randn(m, 576, dtype=dtype)
    w = torch.randn(3072, 576, dtype=dtype)
    for _ in range(5):
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for _ in range(repeats):
        torch.nn.functional.linear(x, w)
    seconds = (time.perf_counter() - start) / repeats
    return 2 * m * 576 * 3072 / seconds / 1e9


def main() -> None:
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'M':>5} {'float32 GFLOP/s':>16} {'bfloat16 GFLOP/s':>17}")
    for m in (1, 8, 32, 128, 512):
        print(f"{m:5d} {gflops(m, torch.float32):16.1f} {gflops(m, torch.bfloat16):17.1f}")


if __name__ == "__main__":
    main()
