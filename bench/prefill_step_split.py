"""Where one full prefill step's time goes on CPU, part by part (wall time of each part, timed
around it): the TTFT case of issue 12, 64 prompts of 128 tokens arriving at once, which the
scheduler runs as 2048-token steps of 16 prefills each.

Each round adds 64 new random-token prompts (no prefix-cache hits), max_tokens 1, and times the
steps until every prefill is done: the whole step; each linear kind (qkv_proj, o_proj,
gate_up_proj, down_proj: the packed oneDNN layers), the attention backend's forward and KV writes,
RMSNorm, SiLU-and-multiply and rotary (the C ops), the embedding, the lm_head (last tokens only),
the sampler, the runner's prepare and the scheduler; "rest of forward" is the model forward less
its timed parts (Python glue, residual views, the q/k/v split). Figures are per 2048-token step,
the median over rounds.

    python bench/prefill_step_split.py --dtype bfloat16
    python bench/prefill_step_split.py --dtype bfloat16 --rounds 8 --ab-parallel-mean

--ab-parallel-mean: rounds alternate between the engine's RMSNorm (torch's mean of squares on the
calling thread) and the same with that mean on all of torch's threads (as before), one table each.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import kvpilot.engine.model_runner as model_runner
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu import layer_ops
from kvpilot.engine.cpu.build import load_library

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_timing import PartTimes

LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
OPS = ("rms_norm", "silu_and_mul", "apply_rotary")
INSIDE_FORWARD = (*LINEARS, *OPS, "attention forward", "KV writes", "embedding")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ab-parallel-mean", action="store_true", help="see the docstring")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, block_size=32, max_num_seqs=64, max_num_batched_tokens=2048)
    rng = random.Random(0)
    times = PartTimes()
    acc, timed, wrap = times.seconds, times.timed, times.wrap

    def run_round(tag: str) -> list[float]:
        """Adds the prompts and steps until none is prefilling; each step's seconds."""
        params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        for i in range(args.num_prompts):
            ids = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            llm.engine.add_request(f"{tag}{i}", ids, params)
        steps = []
        while llm.engine.has_unfinished_requests():
            start = time.perf_counter()
            llm.engine.step()
            steps.append(time.perf_counter() - start)
        return steps

    run_round("warm")  # this step shape, before anything is timed
    runner = llm.engine.runner
    model = runner.model
    for layer in model.model.layers:
        for name in ("qkv_proj", "o_proj"):
            wrap(getattr(layer.self_attn, name), "forward", name)
        for name in ("gate_up_proj", "down_proj"):
            wrap(getattr(layer.mlp, name), "forward", name)
    # The layers share one LayerOps (frozen) and one backend object.
    ops = model.model.ops
    variants = {"engine": dataclasses.replace(ops, **{f: timed(getattr(ops, f), f) for f in OPS})}
    if args.ab_parallel_mean:
        lib = load_library()

        def parallel_mean_rms_norm(x: Any, weight: Any, eps: float, residual: Any = None) -> Any:
            return layer_ops.rms_norm(lib, x, weight, eps, residual, serial_mean=False)

        variants["parallel mean"] = dataclasses.replace(
            variants["engine"], rms_norm=timed(parallel_mean_rms_norm, "rms_norm")
        )
    users = [m for m in model.modules() if getattr(m, "ops", None) is ops]
    backend = model.model.layers[0].self_attn.backend
    wrap(backend, "forward", "attention forward")
    wrap(backend, "write_kv", "KV writes")
    wrap(model.model.embed_tokens, "forward", "embedding")
    wrap(runner, "prepare", "runner.prepare")
    wrap(model, "compute_logits", "lm_head")
    wrap(model, "forward", "model forward")
    wrap(model_runner, "launch_sample", "sampler")  # on CPU the draw itself
    wrap(model_runner, "resolve_sample", "sampler")  # the host copy and the logprobs
    wrap(llm.engine.core.scheduler, "schedule", "scheduler")

    per_round: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    for r in range(args.rounds):
        variant = list(variants)[r % len(variants)]
        for module in users:
            module.ops = variants[variant]
        acc.clear()
        steps = run_round(f"r{r}-")
        tokens = args.num_prompts * args.prompt_len
        scale = 1e3 * 2048 / tokens  # ms per 2048-token step
        parts = {label: s * scale for label, s in acc.items()}
        parts["rest of forward"] = parts["model forward"] - sum(
            parts.get(k, 0.0) for k in INSIDE_FORWARD
        )
        parts["whole step"] = sum(steps) * scale
        per_round[variant].append(parts)
        print(
            f"round {r + 1} ({variant}): {len(steps)} steps, "
            f"{parts['whole step']:.1f} ms per 2048 tokens",
            flush=True,
        )
    for variant, rounds in per_round.items():
        med = {k: statistics.median(p[k] for p in rounds) for k in rounds[0]}
        whole = med["whole step"]
        print(f"\n{variant}: {args.dtype}, {args.num_prompts} x {args.prompt_len}-token prompts,")
        print(f"median of {len(rounds)} rounds, ms per 2048-token prefill step (share):")
        for label, ms in sorted(med.items(), key=lambda kv: -kv[1]):
            print(f"  {label:20s} {ms:8.1f}  {100 * ms / whole:5.1f}%")


if __name__ == "__main__":
    main()
