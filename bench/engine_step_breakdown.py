"""Where kvpilot's offline time goes on CPU: pure-decode steps vs steps that carry prefill tokens,
for each attention backend, side by side in one process.

Same workload as offline_throughput.py (64 SmolLM2 chat requests, 64-128 output tokens, max batch
32). Each model step is timed around ModelRunner.execute; steps whose tokens are all decodes count
as "decode", the rest as "mixed" (prefill chunks, usually with decodes).

A backend name may end in suffixes that put one of torch's ops back in place of the backend's
own (see TORCH_OPS), that send prefill steps through the torch reference attention
(REF_PREFILL), that fuse the MLP's SiLU-and-multiply into oneDNN (ONEDNN_MLP), that give the
C RMSNorm's mean of squares back to torch's threads (PARALLEL_MEAN), or that run the linears on
oneDNN's packed layer instead of kvpilot's kernel (ONEDNN_LINEARS), so a change to one op is A/B'd
in one process:

    python bench/engine_step_breakdown.py --dtype bfloat16 --backends torch,cpu
    python bench/engine_step_breakdown.py --dtype float32 --rounds 2 \
        --backends cpu,cpu-torch-rmsnorm
    python bench/engine_step_breakdown.py --dtype bfloat16 --rounds 2 \
        --backends cpu,cpu-torch-silu,cpu-onednn-mlp
    python bench/engine_step_breakdown.py --dtype bfloat16 --rounds 2 \
        --backends cpu,cpu-ref-prefill
    python bench/engine_step_breakdown.py --dtype bfloat16 --rounds 3 \
        --backends cpu,cpu-parallel-mean
    python bench/engine_step_breakdown.py --dtype float32 --rounds 3 \
        --backends cpu,cpu-onednn-linears

Each kind of step also gets this process's CPU seconds: on a machine shared with other jobs, run
with OMP_NUM_THREADS=1 and compare those, which contention inflates far less than wall time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_linear_ab import onednn_linears as onednn_linears_packed
from offline_throughput import make_requests, prompt_ids, run_kvpilot

# Backend-name suffix -> the LayerOps field it sets back to the torch version in layers.
TORCH_OPS = {"-torch-rmsnorm": "rms_norm", "-torch-silu": "silu_and_mul"}
# Backend-name suffix: the MLP's gate_up as oneDNN linears with SiLU and the multiply as post-ops.
ONEDNN_MLP = "-onednn-mlp"
# A suffix for 'cpu': steps with prefill chunks through the torch reference per sequence (and the
# decode kernel for their decodes), as before the varlen C kernel.
REF_PREFILL = "-ref-prefill"
# A suffix for 'cpu' (last, after any other): the C RMSNorm's torch mean on all of torch's threads,
# as before layer_ops.rms_norm ran it on one.
PARALLEL_MEAN = "-parallel-mean"
# A suffix for 'cpu' (last of all): every linear on oneDNN's packed layer (engine/model/cpu_linear),
# as before kvpilot's own kernel (engine/cpu/linear) took them.
ONEDNN_LINEARS = "-onednn-linears"


def split_backend(name: str) -> tuple[str, list[str], bool, bool]:
    """The attention backend, the LayerOps fields set back to torch, whether the MLP's gate_up
    is fused in oneDNN and whether prefill steps take the reference attention:
    cpu-ref-prefill-torch-rmsnorm-onednn-mlp -> ("cpu", ["rms_norm"], True, True)."""
    fused = name.endswith(ONEDNN_MLP)
    name = name.removesuffix(ONEDNN_MLP)
    fields = []
    while suffix := next((s for s in TORCH_OPS if name.endswith(s)), None):
        name = name.removesuffix(suffix)
        fields.append(TORCH_OPS[suffix])
    ref_prefill = name.endswith(REF_PREFILL)
    return name.removesuffix(REF_PREFILL), fields, fused, ref_prefill


def build_llm(backend: str, args: argparse.Namespace) -> object:
    from kvpilot.engine import LLM, model_runner
    from kvpilot.engine.cpu import layer_ops
    from kvpilot.engine.cpu.build import load_library
    from kvpilot.engine.model import layers

    onednn_linears = backend.endswith(ONEDNN_LINEARS)
    backend = backend.removesuffix(ONEDNN_LINEARS)
    parallel_mean = backend.endswith(PARALLEL_MEAN)
    backend = backend.removesuffix(PARALLEL_MEAN)
    attention_backend, torch_fields, fuse_gate_up, ref_prefill = split_backend(backend)
    with_c_ops, pack = layer_ops.cpu_layer_ops, model_runner.pack_linears
    overrides = {field: getattr(layers, field) for field in torch_fields}
    if parallel_mean:
        lib = load_library()
        overrides.setdefault(
            "rms_norm",
            lambda x, weight, eps, residual=None: layer_ops.rms_norm(
                lib, x, weight, eps, residual, serial_mean=False
            ),
        )
    if overrides:
        layer_ops.cpu_layer_ops = lambda: dataclasses.replace(with_c_ops(), **overrides)
    if fuse_gate_up:
        model_runner.pack_linears = functools.partial(pack, fuse_gate_up=True)
    try:
        with onednn_linears_packed() if onednn_linears else contextlib.nullcontext():
            llm = LLM(
                dtype=args.dtype,
                attention_backend=attention_backend,
                max_num_seqs=args.max_batch,
                max_num_batched_tokens=2048,
            )
        if ref_prefill:
            # One backend object serves every layer.
            llm.engine.runner.model.model.layers[0].self_attn.backend.varlen_kernel = False
        return llm
    finally:
        layer_ops.cpu_layer_ops, model_runner.pack_linears = with_c_ops, pack


def run(backend: str, args: argparse.Namespace) -> None:
    from kvpilot.engine import SamplingParams

    requests = make_requests(args.num_requests, 64, 128, args.seed)
    llm = build_llm(backend, args)
    ids = prompt_ids(llm.tokenizer, requests)
    runner = llm.engine.runner
    execute = runner.execute
    # kind -> [steps, seconds, tokens, CPU seconds of this process]
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])

    def timed(scheduled: list, *rest: object) -> object:
        start, start_cpu = time.perf_counter(), time.process_time()
        result = execute(scheduled, *rest)
        seconds = time.perf_counter() - start
        tokens = sum(item.num_new_tokens for item in scheduled)
        entry = totals["decode" if tokens == len(scheduled) else "mixed"]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += tokens
        entry[3] += time.process_time() - start_cpu
        return result

    llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    runner.execute = timed
    result = run_kvpilot(llm, ids, requests)
    seconds = result.seconds
    print(
        f"\n{backend} ({args.dtype}): {seconds:.1f} s, {result.tokens_per_s:.1f} output tok/s "
        f"({torch.get_num_threads()} threads)"
    )
    # CPU seconds: what a machine shared with other jobs inflates least (with OMP_NUM_THREADS=1
    # no thread spins waiting for a descheduled sibling), though caches are still shared.
    for kind, (steps, secs, tokens, cpu) in sorted(totals.items()):
        print(
            f"  {kind:6} steps {int(steps):4d}  {secs:6.1f} s  {1000 * secs / steps:7.1f} ms/step  "
            f"tokens {int(tokens)}  CPU {cpu:6.1f} s ({1000 * cpu / steps:7.1f} ms/step)"
        )
    outside = seconds - sum(v[1] for v in totals.values())
    print(f"  outside the model runner (scheduling, detokenizing): {outside:.1f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument(
        "--backends",
        default="torch,cpu",
        help="comma-separated attention backends, each with optional suffixes "
        f"{REF_PREFILL} (cpu only), then {list(TORCH_OPS)}, then {ONEDNN_MLP}, then "
        f"{PARALLEL_MEAN} (cpu only)",
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
