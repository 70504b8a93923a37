"""Micro-benchmark of the batched LoRA delta on CPU, at SmolLM2-135M's projection shapes (hidden
576, q 576 and k/v 192 merged into qkv, o 576, gate_up 2 x 1536, down 1536 -> 576): the time of
one layer's four add_lora calls through the C kernel (kvpilot.engine.lora.ops.add_lora, dispatch
included) and through the segmented torch path (add_lora_torch), against the layer's four base
projections themselves (F.linear on the same x).

8 adapters of rank 16 in an 8-slot stack, the tokens spread round robin over them (every token
has an adapter); decode batches of 32 and 64 tokens and a 512-token prefill step; float32 and
bfloat16. Each figure is the median of --repeats timed runs (after warm-up runs), in microseconds
of wall time, or with --cpu-time of the calling thread's CPU time (one thread only: on a machine
whose cores other work shares, the time the thread was not running drops out).

    python bench/lora_ops.py [--repeats 200] [--threads N | --cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvpilot.engine.cpu.build import load_library
from kvpilot.engine.lora.ops import LoRAMapping, add_lora, add_lora_torch, build_mapping

HIDDEN, Q, KV, INTER = 576, 576, 192, 1536
# (name, in_features, bounds of the merged output's subs)
PROJECTIONS = (
    ("qkv", HIDDEN, (0, Q, Q + KV, Q + 2 * KV)),
    ("o", Q, (0, HIDDEN)),
    ("gate_up", HIDDEN, (0, INTER, 2 * INTER)),
    ("down", INTER, (0, HIDDEN)),
)
NUM_ADAPTERS, RANK = 8, 16
BATCHES = (("decode", 32), ("decode", 64), ("prefill", 512))
DTYPES = (torch.float32, torch.bfloat16)


def median_us(fn: Callable[[], None], repeats: int, clock: Callable[[], float]) -> float:
    for _ in range(max(3, repeats // 10)):
        fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times) * 1e6


def layer(dtype: torch.dtype, tokens: int) -> list[dict[str, object]]:
    """Per projection: x, the base weight, out, and the stacks of A and B."""
    gen = torch.Generator().manual_seed(0)
    parts = []
    for _, in_features, bounds in PROJECTIONS:
        out_features, num_sub = bounds[-1], len(bounds) - 1
        parts.append(
            {
                "x": torch.randn(tokens, in_features, generator=gen).to(dtype),
                "weight": torch.randn(out_features, in_features, generator=gen).to(dtype) * 0.05,
                "out": torch.zeros(tokens, out_features, dtype=dtype),
                "a": torch.randn(NUM_ADAPTERS, num_sub, RANK, in_features, generator=gen).to(dtype),
                "b": torch.randn(NUM_ADAPTERS, out_features, RANK, generator=gen).to(dtype),
                "bounds": bounds,
            }
        )
    return parts


def run(
    dtype: torch.dtype, tokens: int, repeats: int, clock: Callable[[], float]
) -> tuple[float, float, float]:
    parts = layer(dtype, tokens)
    mapping: LoRAMapping = build_mapping([t % NUM_ADAPTERS for t in range(tokens)])

    def with_c() -> None:
        for p in parts:
            add_lora(p["out"], p["x"], p["a"], p["b"], p["bounds"], mapping)  # type: ignore[arg-type]

    def with_torch() -> None:
        for p in parts:
            add_lora_torch(p["out"], p["x"], p["a"], p["b"], p["bounds"], mapping)  # type: ignore[arg-type]

    def base() -> None:
        for p in parts:
            F.linear(p["x"], p["weight"])  # type: ignore[arg-type]

    c_us, torch_us, base_us = (median_us(fn, repeats, clock) for fn in (with_c, with_torch, base))
    return c_us, torch_us, base_us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--cpu-time", action="store_true", help="the thread's CPU time, 1 thread")
    args = parser.parse_args()
    if args.cpu_time:
        args.threads = 1
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if load_library() is None:
        raise SystemExit("no C compiler: the C kernel cannot be built here")
    print(
        f"SmolLM2-135M projections, {NUM_ADAPTERS} adapters of rank {RANK}, "
        f"{torch.get_num_threads()} threads; us per layer (4 projections) of "
        f"{'CPU' if args.cpu_time else 'wall'} time, median of {args.repeats}"
    )
    columns = ("C", "torch", "F.linear", "C/lin", "torch/C")
    header = f"{'dtype':9} {'batch':>13} " + " ".join(f"{c:>9}" for c in columns)
    print(header)
    print("-" * len(header))
    for dtype in DTYPES:
        for kind, tokens in BATCHES:
            c_us, torch_us, base_us = run(dtype, tokens, args.repeats, clock)
            name = str(dtype).removeprefix("torch.")
            print(
                f"{name:9} {f'{kind} {tokens}':>13} {c_us:9.1f} {torch_us:9.1f} {base_us:9.1f} "
                f"{c_us / base_us:9.3f} {torch_us / c_us:9.2f}"
            )


if __name__ == "__main__":
    main()
