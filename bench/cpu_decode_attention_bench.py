"""The C paged decode-attention kernel against a variant of it built with other flags, A/B inside
real decode steps (by default the variant is the kernel without its software prefetch).

A micro-benchmark of the kernel alone cannot say what a step sees: between two layers' attention
calls the other layers' weights and activations pass through the caches, the TLB and the memory
controller. So this runs the engine: `--batch` random-token requests of 64-192 prompt tokens
decode together (SmolLM2, block size 32, blocks handed out as a running server hands them out);
after their prefills, decode steps alternate, in blocks of `--block-steps`, between the library as
the engine builds it and the same source built with `--variant-flags`, and the attention backend's
forward is timed in each (every layer's call, summed per step). It ends with the largest
difference between the two libraries' outputs on layer 0's cache (0 for the prefetch).

    python bench/cpu_decode_attention_bench.py --dtype bfloat16 --batch 64
    python bench/cpu_decode_attention_bench.py --variant-flags "-DSOME_MACRO"
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from kvpilot.engine import LLM
from kvpilot.engine.cpu.attention_backend import paged_decode
from kvpilot.engine.cpu.build import load_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import add_random_requests, finish_prefills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=6, help="alternating blocks per variant")
    ap.add_argument("--block-steps", type=int, default=5, help="decode steps per block")
    ap.add_argument(
        "--variant-flags",
        default="-DKVPILOT_NO_PREFETCH",
        help="compiler flags of the library the engine's own is compared with",
    )
    args = ap.parse_args()
    variant = f"with {args.variant_flags}"
    libs = {"engine": load_library(), variant: load_library(tuple(args.variant_flags.split()))}
    if any(lib is None for lib in libs.values()):
        raise SystemExit("no C compiler: the kernel cannot be built here")
    llm = LLM(dtype=args.dtype, block_size=32, max_num_seqs=args.batch)
    backend = llm.engine.runner.model.model.layers[0].self_attn.backend
    # Enough tokens that no request ends before the last measured step: the first ones to be
    # prefilled already decode while the others' prefill steps run.
    max_tokens = 2 * args.blocks * args.block_steps + 4 + 32
    add_random_requests(llm, random.Random(0), args.batch, "r", max_tokens)
    finish_prefills(llm)
    for _ in range(4):
        llm.engine.step()  # warm

    forward = backend.forward
    spent = [0.0]

    def timed_forward(query, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        out = forward(query, k_cache, v_cache, meta, scale)
        spent[0] += time.perf_counter() - start
        return out

    backend.forward = timed_forward
    per_step: dict[str, list[float]] = {name: [] for name in libs}
    names = list(libs)
    for block in range(2 * args.blocks):
        name = names[block % 2]
        backend.lib = libs[name]
        for _ in range(args.block_steps):
            spent[0] = 0.0
            llm.engine.step()
            per_step[name].append(spent[0])
    backend.forward = forward
    # The same bits: layer 0's attention over the live batch through each library.
    outs = [_one_layer_decode(llm, libs[name]) for name in names]
    difference = (outs[0].float() - outs[1].float()).abs().max().item()
    backend.lib = libs["engine"]
    batch = llm.engine.stats().num_running
    assert batch == args.batch, f"only {batch} of {args.batch} requests ran to the end"
    print(f"{args.dtype}, batch {batch}, attention per decode step (all layers), "
          f"{args.blocks} blocks of {args.block_steps} steps per variant:")  # fmt: skip
    for name, times in per_step.items():
        print(f"  {name}: median {statistics.median(times) * 1e3:6.2f} ms, "
              f"min {min(times) * 1e3:6.2f} ms")  # fmt: skip
    ratio = statistics.median(per_step[variant]) / statistics.median(per_step["engine"])
    print(f"  variant / engine: {ratio:.2f}x; largest difference in layer 0's output: "
          f"{difference:.3g}")  # fmt: skip


def _one_layer_decode(llm: LLM, lib: object) -> torch.Tensor:
    """Layer 0's attention for every running sequence (a random query), through `lib`."""
    runner = llm.engine.runner
    running = llm.engine.scheduler.running
    k_cache, v_cache = runner.kv_caches[0]
    tables = [seq.block_table for seq in running]
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([seq.num_computed_tokens for seq in running], dtype=torch.int32)
    cfg = runner.model_config
    gen = torch.Generator().manual_seed(0)
    shape = (len(running), cfg.num_attention_heads, cfg.head_dim)
    query = torch.randn(shape, generator=gen).to(k_cache.dtype)
    return paged_decode(lib, query, k_cache, v_cache, block_tables, seq_lens, cfg.head_dim**-0.5)


if __name__ == "__main__":
    main()
