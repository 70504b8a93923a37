"""Where one decode step's time goes, part by part (wall time of each part, timed around it).

64 random-token requests of 64-192 prompt tokens decode together (block size 32); after their
prefills, 20 steps at batch 64 are timed: the whole step, the model's forward, the attention
backend's forward (the C decode kernel on CPU) and KV writes, the decoder's linears, RMSNorm,
SiLU-and-multiply and rotary (inside the forward), the lm_head, the sampler, the output processor,
the runner's prepare and the scheduler.

    python bench/decode_step_split.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from pathlib import Path

import kvpilot.engine.model_runner as model_runner
from kvpilot.engine import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import PartTimes, add_random_requests, finish_prefills

ap = argparse.ArgumentParser(description=__doc__)
ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
ap.add_argument("--batch", type=int, default=64)
ap.add_argument("--steps", type=int, default=20)
args = ap.parse_args()
llm = LLM(dtype=args.dtype, block_size=32, max_num_seqs=args.batch)
rng = random.Random(0)
add_random_requests(llm, rng, args.batch, "w", 8)  # warm-up: this batch's shapes
while llm.engine.has_unfinished_requests():
    llm.engine.step()
runner = llm.engine.runner
times = PartTimes()
acc, wrap = times.seconds, times.wrap

backend = runner.model.model.layers[0].self_attn.backend  # one backend object serves every layer
wrap(backend, "forward", "attention forward")
wrap(backend, "write_kv", "KV writes")
for layer in runner.model.model.layers:
    for name in ("qkv_proj", "o_proj"):
        wrap(getattr(layer.self_attn, name), "forward", "decoder linears")
    for name in ("gate_up_proj", "down_proj"):
        wrap(getattr(layer.mlp, name), "forward", "decoder linears")
ops = runner.model.model.ops  # one LayerOps serves every module
timed_ops = dataclasses.replace(
    ops,
    rms_norm=times.timed(ops.rms_norm, "RMSNorm"),
    silu_and_mul=times.timed(ops.silu_and_mul, "SiLU-and-multiply"),
    apply_rotary=times.timed(ops.apply_rotary, "rotary"),
)
for module in runner.model.modules():
    if getattr(module, "ops", None) is ops:
        module.ops = timed_ops
wrap(runner, "prepare", "runner.prepare")
wrap(runner.model, "compute_logits", "lm_head")
wrap(runner.model, "forward", "model forward")
wrap(model_runner, "launch_sample", "sampler")  # on CPU the draw itself
wrap(model_runner, "resolve_sample", "sampler")  # the host copy and the logprobs
wrap(llm.engine.core.scheduler, "schedule", "scheduler")
wrap(llm.engine.processor, "process", "output processor")
add_random_requests(llm, rng, args.batch, "p", 64)
finish_prefills(llm)  # untimed
acc.clear()
start = time.perf_counter()
for _ in range(args.steps):
    llm.engine.step()
per_step = (time.perf_counter() - start) / args.steps * 1000
print(
    f"{args.dtype} decode steps at batch {llm.engine.stats().num_running}: {per_step:.1f} ms/step"
)
for label, seconds in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {label:20s} {seconds / args.steps * 1000:7.2f} ms/step")
