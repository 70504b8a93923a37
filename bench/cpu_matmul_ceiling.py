"""The CPU's matmul ceiling for SmolLM2's shapes, float32 vs bfloat16.

What any engine on this machine can reach at a given batch: GFLOP/s for [M x 576] . [576 x 3072]
(the gate/up projection).

    python bench/cpu_matmul_ceiling.py
    python bench/cpu_matmul_ceiling.py --packed   # F.linear vs oneDNN-packed, per shape and dtype

--packed times every linear shape of SmolLM2 (and its 49152-row lm_head) in float32 and bfloat16,
plain F.linear against the packed layer the engine uses on CPU (kvpilot.engine.model.cpu_linear),
side by side in one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

SMOLLM2_SHAPES = {  # name: (out_features, in_features)
    "qkv_proj": (960, 576),
    "o_proj": (576, 576),
    "gate_up_proj": (3072, 576),
    "down_proj": (576, 1536),
    "lm_head": (49152, 576),
}


def seconds_per_call(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def gflops(m: int, dtype: torch.dtype, repeats: int = 100) -> float:
    x = torch.randn(m, 576, dtype=dtype)
    w = torch.randn(3072, 576, dtype=dtype)
    return 2 * m * 576 * 3072 / seconds_per_call(lambda: F.linear(x, w), repeats) / 1e9


def packed_table(batch_sizes: tuple[int, ...]) -> None:
    from kvpilot.engine.model.cpu_linear import PACKED_DTYPES, PackedLinear, packing_available

    print(
        f"{'dtype':>9} {'shape':>13} {'M':>5} {'F.linear us':>12} {'packed us':>10} {'speed-up':>9}"
    )
    for dtype in PACKED_DTYPES:
        if not packing_available(dtype):
            print(f"{dtype}: this torch/CPU has no oneDNN packed linear")
            continue
        for name, (n, k) in SMOLLM2_SHAPES.items():
            linear = nn.Linear(k, n, bias=False).to(dtype)
            packed = PackedLinear(linear, batch_hint=32)
            for m in batch_sizes:
                x = torch.randn(m, k).to(dtype)
                repeats = 10 if name == "lm_head" and m > 64 else 50
                plain_s = seconds_per_call(lambda: F.linear(x, linear.weight), repeats)  # noqa: B023
                packed_s = seconds_per_call(lambda: packed(x), repeats)  # noqa: B023
                print(
                    f"{str(dtype)[6:]:>9} {name:>13} {m:5d} {plain_s * 1e6:12.0f} "
                    f"{packed_s * 1e6:10.0f} {plain_s / packed_s:8.2f}x"
                )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--packed", action="store_true", help="plain vs packed bfloat16 linear")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.packed:
        packed_table((1, 32, 256))
        return
    print(f"{'M':>5} {'float32 GFLOP/s':>16} {'bfloat16 GFLOP/s':>17}")
    for m in (1, 8, 32, 128, 512):
        print(f"{m:5d} {gflops(m, torch.float32):16.1f} {gflops(m, torch.bfloat16):17.1f}")


if __name__ == "__main__":
    main()
