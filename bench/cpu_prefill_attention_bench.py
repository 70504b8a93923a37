"""One layer's attention for a step with prefill chunks on CPU: the varlen C kernel (one call for
the whole step) against the path it replaced (torch SDPA per prefill sequence, plus the C decode
kernel for the step's decodes), at SmolLM2-135M's shape (9 query / 3 KV heads, head_dim 64) and
Llama-3-8B's (32 / 8, 128), block size 32, float32 and bfloat16. Milliseconds per call, the
fastest of 15 (SmolLM2) or 5 (8B) calls. Also a decode-only step through both C kernels
(paged_decode vs the varlen kernel).

--model-step: instead, SmolLM2-135M's whole forward pass (30 layers, the bundled weights) over one
2048-token step, the same step with the varlen kernel on and off in turn (fastest of --rounds
each): the attention's share of a prefill step, without the scheduler's variation.

    python bench/cpu_prefill_attention_bench.py
    python bench/cpu_prefill_attention_bench.py --model-step --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.cpu.attention_backend import CpuAttentionBackend, paged_attention, paged_decode

BLOCK_SIZE = 32
SHAPES = {"smollm2": (9, 3, 64), "llama3-8b": (32, 8, 128)}


def ms_per_call(fn: Callable[[], object], calls: int) -> float:
    """The fastest of `calls` single calls (after one warm-up): on a VM shared with other work,
    the least disturbed call."""
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def step_metadata(
    q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, slots: torch.Tensor
) -> AttentionMetadata:
    """The step's metadata from its per-sequence query and context lengths."""
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slots,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(q_lens),
        seq_lens_cpu=tuple(seq_lens),
    )


def make_step(
    seqs: list[tuple[int, int]], heads: tuple[int, int, int], dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(cached prefix, query length) per sequence -> query, caches (blocks shuffled), metadata."""
    num_heads, num_kv_heads, head_dim = heads
    gen = torch.Generator().manual_seed(0)
    q_lens = [q for _, q in seqs]
    seq_lens = [p + q for p, q in seqs]
    nblocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    perm = torch.randperm(sum(nblocks), generator=gen)
    tables = torch.zeros(len(seqs), max(nblocks), dtype=torch.int32)
    offset = 0
    for i, n in enumerate(nblocks):
        tables[i, :n] = perm[offset : offset + n].int()
        offset += n
    shape = (sum(nblocks), BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    slots = torch.zeros(sum(q_lens), dtype=torch.int64)
    return query, k_cache, v_cache, step_metadata(q_lens, seq_lens, tables, slots)


STEPS: dict[str, list[tuple[int, int]]] = {
    "16 x 128 prefill": [(0, 128)] * 16,
    "2 x 1024 prefill": [(0, 1024)] * 2,
    "1536 prefill + 32 decodes": [(0, 512), (512, 512), (256, 512)] + [(200, 1)] * 32,
    "8 x 256 over 512 cached": [(512, 256)] * 8,
}


def model_step(dtype: str, rounds: int) -> None:
    """One forward pass over a fresh 2048-token step, varlen kernel on vs off, interleaved."""
    from kvpilot.engine import LLM
    from kvpilot.engine.model.llama import ForwardContext

    llm = LLM(dtype=dtype, attention_backend="cpu", max_num_batched_tokens=2048)
    runner = llm.engine.runner
    backend = runner.model.model.layers[0].self_attn.backend
    block_size = runner.kv_caches[0][0].shape[1]
    for k_cache, v_cache in runner.kv_caches:  # the cached prefixes: finite values, not garbage
        k_cache.zero_()
        v_cache.zero_()
    vocab = runner.model_config.vocab_size
    for name, seqs in STEPS.items():
        q_lens = [q for _, q in seqs]
        seq_lens = [p + q for p, q in seqs]
        tables, slots, positions, next_block = [], [], [], 0
        for (prefix, _), seq_len in zip(seqs, seq_lens, strict=True):
            n = -(-seq_len // block_size)
            tables.append(list(range(next_block, next_block + n)))
            next_block += n
            for pos in range(prefix, seq_len):
                slots.append(tables[-1][pos // block_size] * block_size + pos % block_size)
                positions.append(pos)
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables]).int()
        meta = step_metadata(q_lens, seq_lens, block_tables, torch.tensor(slots))
        ctx = ForwardContext(torch.tensor(positions), meta, runner.kv_caches)
        ids = torch.randint(0, vocab, (len(positions),), generator=torch.Generator().manual_seed(0))
        best = {True: float("inf"), False: float("inf")}
        with torch.inference_mode():
            for _ in range(rounds):
                for on in (True, False):
                    backend.varlen_kernel = on
                    start = time.perf_counter()
                    runner.model(ids, ctx)
                    best[on] = min(best[on], time.perf_counter() - start)
        print(
            f"{dtype:>9} {name:>26}: varlen {1e3 * best[True]:7.1f} ms, old path "
            f"{1e3 * best[False]:7.1f} ms per forward ({best[False] / best[True]:.2f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="smollm2,llama3-8b")
    ap.add_argument("--model-step", action="store_true")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if args.model_step:
        model_step(args.dtype, args.rounds)
        return
    old, new = CpuAttentionBackend(), CpuAttentionBackend()
    if new.lib is None:
        raise SystemExit("no C compiler: the CPU kernels could not be built")
    old.varlen_kernel = False
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, block size {BLOCK_SIZE}")
    print(f"{'shape':>9} {'dtype':>9} {'step':>26} {'old ms':>8} {'varlen ms':>10} {'speed-up':>9}")
    for shape in args.shapes.split(","):
        heads = SHAPES[shape]
        scale = heads[2] ** -0.5
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).removeprefix("torch.")
            for step, seqs in STEPS.items():
                q, k, v, meta = make_step(seqs, heads, dtype)
                calls = 15 if shape == "smollm2" else 5
                t_old = ms_per_call(partial(old.forward, q, k, v, meta, scale), calls)
                t_new = ms_per_call(partial(new.forward, q, k, v, meta, scale), calls)
                print(
                    f"{shape:>9} {name:>9} {step:>26} {t_old:>8.2f} {t_new:>10.2f} "
                    f"{t_old / t_new:>8.2f}x"
                )
            # Decode only: the engine keeps paged_decode for these; the varlen kernel routes them to
            # the same per-(sequence, kv head) code, so this is the cost of its set-up.
            q, k, v, meta = make_step([(200, 1)] * 64, heads, dtype)
            tables, lens = meta.block_tables, meta.seq_lens
            t_dec = ms_per_call(partial(paged_decode, new.lib, q, k, v, tables, lens, scale), 40)
            t_var = ms_per_call(partial(paged_attention, new.lib, q, k, v, meta, scale), 40)
            print(
                f"{shape:>9} {name:>9} {'64 decodes (decode kernel)':>26} {t_dec:>8.2f} "
                f"{t_var:>10.2f} {t_dec / t_var:>8.2f}x"
            )


if __name__ == "__main__":
    main()
