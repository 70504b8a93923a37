"""The paged-attention kernel's launch settings at the batches a loaded server runs, on a GPU.

Under the 1000-request load with 512 running sequences (bench/gpu_offline_throughput.py, idle
part's kernel breakdown) attention took 41% of the device time, at about 41% of the bandwidth its
KV reads need: short contexts (a few hundred tokens) in large batches, where per-program overhead
weighs more than at the long contexts the defaults were tuned on. This sweeps, at the Llama-3.1-8B
shape in bf16:
- decode batches of 256 and 512 sequences with ShareGPT-like context lengths (lognormal, mean
  ~400): keys per iteration (tile_n) x warps x pipeline stages;
- a mixed step (384 such decodes + one 256-token prefill chunk) in one launch, where the decode
  rows run in the prefill tiling, against the decodes and the chunk in two launches.
Achieved bandwidth = KV bytes read / time. Timing: triton.testing.do_bench, median.

    python bench/attention_tuning.py --out bench/out/attention_tuning.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_bench import HEAD_DIM, KV_HEADS, bench_ms, paged_batch, result_header


def contexts(batch: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(330), sigma=0.6, size=batch)
    return [int(x) for x in np.clip(lengths, 16, 4000)]


def sub_metadata(meta: Any, first: int, last: int) -> Any:
    """The metadata of sequences [first, last) of a batch (their tokens are contiguous)."""
    starts = meta.query_start_loc[first : last + 1]
    return dataclasses.replace(
        meta,
        query_start_loc=(starts - starts[0]).contiguous(),
        seq_lens=meta.seq_lens[first:last],
        block_tables=meta.block_tables[first:last],
        slot_mapping=meta.slot_mapping[:0],
        max_query_len=max(meta.query_lens_cpu[first:last]),
        max_seq_len=max(meta.seq_lens_cpu[first:last]),
        query_lens_cpu=meta.query_lens_cpu[first:last],
        seq_lens_cpu=meta.seq_lens_cpu[first:last],
    )


def kv_gb(meta: Any) -> float:
    return sum(meta.seq_lens_cpu) * KV_HEADS * HEAD_DIM * 2 * 2 / 1e9


def sweep_decode(batch: int, scale: float) -> list[dict[str, Any]]:
    import torch

    from kvpilot.engine.kernels.attention import paged_attention

    b = paged_batch([(c - 1, 1) for c in contexts(batch)], torch.bfloat16)
    q, kc, vc, meta = b["query"], b["k_cache"], b["v_cache"], b["meta"]
    gb = kv_gb(meta)
    case = f"decode b={batch}"
    default_ms = bench_ms(lambda: paged_attention(q, kc, vc, meta, scale))
    rows = [{"case": case, "config": "default", "ms": default_ms, "gb_s": gb / default_ms * 1e3}]
    print(rows[-1], flush=True)
    for tile_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        try:
            ms = bench_ms(
                lambda t=tile_n, w=warps, s=stages: paged_attention(
                    q, kc, vc, meta, scale, num_splits=1, tile_n=t, num_warps=w, num_stages=s
                )
            )
        except Exception as exc:  # out of shared memory / registers for this config
            rows.append({"case": case, "config": [tile_n, warps, stages], "error": str(exc)[:200]})
            continue
        rows.append({"case": case, "config": [tile_n, warps, stages], "ms": ms,
                     "gb_s": gb / ms * 1e3})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("bench/out/attention_tuning.json"))
    args = p.parse_args(argv)
    import torch

    from kvpilot.engine.kernels.attention import paged_attention

    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    scale = 1 / math.sqrt(HEAD_DIM)
    rows: list[dict[str, Any]] = []
    result = {**result_header("attention_tuning.py"), "rows": rows}

    def save() -> None:  # after every part: a run cut short keeps what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    for batch in (512, 256):
        rows += sweep_decode(batch, scale)
        save()
        best = min((r for r in rows if r["case"] == f"decode b={batch}" and "ms" in r),
                   key=lambda r: r["ms"])  # fmt: skip
        print("best", best, flush=True)

    # A mixed step: 384 decodes, then one 256-token chunk after a 200-token prefix.
    ctx = contexts(384, seed=1)
    seqs = [(c - 1, 1) for c in ctx] + [(200, 256)]
    b = paged_batch(seqs, torch.bfloat16)
    q, kc, vc, meta = b["query"], b["k_cache"], b["v_cache"], b["meta"]
    gb = kv_gb(meta)
    one = bench_ms(lambda: paged_attention(q, kc, vc, meta, scale))
    decodes, chunk = sub_metadata(meta, 0, 384), sub_metadata(meta, 384, 385)
    q_dec, q_chunk = q[:384], q[384:]

    def two_launches() -> None:
        paged_attention(q_dec, kc, vc, decodes, scale)
        paged_attention(q_chunk, kc, vc, chunk, scale)

    two = bench_ms(two_launches)
    dec_only = bench_ms(lambda: paged_attention(q_dec, kc, vc, decodes, scale))
    rows.append({"case": "mixed 384 decodes + chunk 256", "one_launch_ms": one,
                 "two_launches_ms": two, "decodes_alone_ms": dec_only, "gb": gb})  # fmt: skip
    print(rows[-1], flush=True)
    save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
