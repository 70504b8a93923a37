"""Where kvpilot's offline time goes on CPU: pure-decode steps vs steps that carry prefill tokens,
for each attention backend, side by side in one process.

Same workload as offline_throughput.py (64 SmolLM2 chat requests, 64-128 output tokens, max batch
32). Each model step is timed around ModelRunner.execute; steps whose tokens are all decodes count
as "decode", the rest as "mixed" (prefill chunks, usually with decodes).

    python bench/engine_step_breakdown.py --dtype bfloat16 --backends torch,cpu
    python bench/engine_step_breakdown.py --dtype float32 --rounds 2 \
        --backends cpu,cpu-torch-rmsnorm
    python bench/engine_step_breakdown.py --dtype bfloat16 --rounds 2 \
        --backends cpu,cpu-ref-prefill
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from offline_throughput import make_requests, prompt_ids, run_kvpilot

TORCH_RMSNORM = "-torch-rmsnorm"  # a backend name suffix: that backend with torch's RMSNorm
# A suffix for 'cpu': steps with prefill chunks through the torch reference per sequence (and the
# decode kernel for their decodes), as before the varlen C kernel.
REF_PREFILL = "-ref-prefill"


def build_llm(backend: str, args: argparse.Namespace) -> object:
    from kvpilot.engine import LLM
    from kvpilot.engine.cpu import layer_ops
    from kvpilot.engine.model import layers

    def build() -> object:
        llm = LLM(
            dtype=args.dtype,
            attention_backend=backend.removesuffix(TORCH_RMSNORM).removesuffix(REF_PREFILL),
            max_num_seqs=args.max_batch,
            max_num_batched_tokens=2048,
        )
        if backend.endswith(REF_PREFILL):
            # One backend object serves every layer.
            llm.engine.runner.model.model.layers[0].self_attn.backend.varlen_kernel = False
        return llm

    if not backend.endswith(TORCH_RMSNORM):
        return build()
    with_c_rms_norm = layer_ops.cpu_layer_ops
    layer_ops.cpu_layer_ops = lambda: dataclasses.replace(
        with_c_rms_norm(), rms_norm=layers.rms_norm
    )
    try:
        return build()
    finally:
        layer_ops.cpu_layer_ops = with_c_rms_norm


def run(backend: str, args: argparse.Namespace) -> None:
    from kvpilot.engine import SamplingParams

    requests = make_requests(args.num_requests, 64, 128, args.seed)
    llm = build_llm(backend, args)
    ids = prompt_ids(llm.tokenizer, requests)
    runner = llm.engine.runner
    execute = runner.execute
    # kind -> [steps, seconds, tokens]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])

    def timed(scheduled: list, *rest: object) -> object:
        start = time.perf_counter()
        result = execute(scheduled, *rest)
        seconds = time.perf_counter() - start
        tokens = sum(item.num_new_tokens for item in scheduled)
        entry = totals["decode" if tokens == len(scheduled) else "mixed"]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += tokens
        return result

    llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runner.execute = timed
    result = run_kvpilot(llm, ids, requests)
    seconds = result.seconds
    print(
        f"\n{backend} ({args.dtype}): {seconds:.1f} s, {result.tokens_per_s:.1f} output tok/s "
        f"({torch.get_num_threads()} threads)"
    )
    for kind, (steps, secs, tokens) in sorted(totals.items()):
        print(
            f"  {kind:6} steps {int(steps):4d}  {secs:6.1f} s  {1000 * secs / steps:7.1f} ms/step  "
            f"tokens {int(tokens)}"
        )
    outside = seconds - sum(v[1] for v in totals.values())
    print(f"  outside the model runner (scheduling, detokenizing): {outside:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--backends",
        default="torch,cpu",
        help=f"comma-separated attention backends ({TORCH_RMSNORM} suffix: with torch's RMSNorm; "
        f"cpu{REF_PREFILL}: prefill steps through the torch reference)",
    )
    ap.add_argument("--rounds", type=int, default=1, help="run the backends in turn this often")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for _ in range(args.rounds):
        for backend in args.backends.split(","):
            run(backend, args)


if __name__ == "__main__":
    main()
