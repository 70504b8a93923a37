"""Offline throughput on one GPU at the Llama-3.1-8B shape, against published SGLang/vLLM figures.

Four parts, each runnable alone (--parts), all on dummy bf16 weights (no download):
- kvpilot: 1000 ShareGPT-like requests through kvpilot.engine.LLM, ignore_eos; output tokens/s.
- idle: the GPU idle fraction under that load, from a torch.profiler trace of steady-state steps
  (1 - union of CUDA kernel intervals / wall time of the window).
- single: one request alone, decode tokens/s against the bandwidth roofline (weight bytes + KV bytes
  per token over the measured device-to-device copy bandwidth).
- hf: transformers generate on the same shape and workload, static batches (left-padded, every batch
  runs to its longest output), on a subset; counted in requested output tokens only.
- idle_decode: the same idle fraction over decode-only steps (--idle-decode-batches requests of 128
  prompt tokens each, profiled once every prompt is in): where graphs matter most.
- subset: the first --subset-requests requests of the same workload through kvpilot (the attention
  backends and graphs-on/off compared on identical requests where the slower ones would take long).
- host: cProfile of the host over steady steps under the whole workload (where the host time of a
  step goes, without the torch profiler's per-op overhead).
- sweep: the kvpilot part again for each --sweep setting of max_num_seqs:max_num_batched_tokens
  (each at most the engine's own: the scheduler's limits change between runs, the engine and its
  graphs stay), to find the best setting in one engine start.
- timeline: the kvpilot part again with every step timed on the device (CUDA events around each
  launch; bench/step_timeline.py): where the run's time goes by batch size, the long tail of a few
  sequences included.

Decode steps replay CUDA graphs unless --enforce-eager (they need the triton backend); the graphs'
capture time and memory are part of the JSON result.

The workload generator (`sharegpt_like_lengths`): lognormal input and output lengths with means
220 and 185 tokens (sigma 0.9 and 0.8; ShareGPT's spread, long tail included), clipped like vLLM's
ShareGPT filter (4 <= input <= 1024, 4 <= output, input + output <= 2048), rescaled once so the
clipped means land on the targets; random token ids; numpy seed 0. Its realized statistics are part
of the JSON result.

    python bench/gpu_offline_throughput.py --parts kvpilot,idle,single,hf
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}
PARTS = frozenset(
    ("subset", "kvpilot", "sweep", "timeline", "idle", "host", "idle_decode", "single", "hf")
)
PUBLISHED_OUTPUT_TOKENS_PER_S = {"SGLang": 16200, "LMDeploy": 16100, "vLLM": 12600}
GOAL_OUTPUT_TOKENS_PER_S = 16000


@dataclass(frozen=True)
class Workload:
    input_lens: list[int]
    output_lens: list[int]
    prompts: list[list[int]]

    def stats(self) -> dict[str, float]:
        inp, out = np.array(self.input_lens), np.array(self.output_lens)
        return {
            "num_requests": len(inp),
            "input_mean": float(inp.mean()),
            "input_median": float(np.median(inp)),
            "input_p99": float(np.percentile(inp, 99)),
            "output_mean": float(out.mean()),
            "output_median": float(np.median(out)),
            "output_p99": float(np.percentile(out, 99)),
            "total_output_tokens": int(out.sum()),
        }


def _lognormal_with_mean(
    rng: np.random.Generator, mean: float, sigma: float, size: int
) -> np.ndarray:
    # E[lognormal(mu, sigma)] = exp(mu + sigma^2 / 2)
    return rng.lognormal(math.log(mean) - sigma**2 / 2, sigma, size)


def sharegpt_like_lengths(
    num_requests: int,
    *,
    input_mean: float = 220.0,
    output_mean: float = 185.0,
    input_sigma: float = 0.9,
    output_sigma: float = 0.8,
    max_input: int = 1024,
    max_total: int = 2048,
    seed: int = 0,
) -> tuple[list[int], list[int]]:
    """(input_lens, output_lens): see the module docstring."""
    rng = np.random.default_rng(seed)
    raw_in = _lognormal_with_mean(rng, input_mean, input_sigma, num_requests)
    raw_out = _lognormal_with_mean(rng, output_mean, output_sigma, num_requests)

    def clip(inp: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        inp = np.clip(np.rint(inp), 4, max_input)
        out = np.clip(np.rint(out), 4, max_total - inp)
        return inp, out

    inp, out = clip(raw_in, raw_out)
    # One rescale brings the clipped means back to the targets (the clip cut the long tail).
    inp, out = clip(raw_in * input_mean / inp.mean(), raw_out * output_mean / out.mean())
    return inp.astype(int).tolist(), out.astype(int).tolist()


def build_workload(num_requests: int, vocab_size: int, seed: int = 0) -> Workload:
    input_lens, output_lens = sharegpt_like_lengths(num_requests, seed=seed)
    rng = np.random.default_rng(seed + 1)
    # Random ids: no two prompts share a prefix, so the prefix cache neither helps nor hurts.
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in input_lens]
    return Workload(input_lens, output_lens, prompts)


def write_model_dir(root: Path) -> Path:
    """A config-only model directory: the engine's load_format='dummy' needs nothing else."""
    path = root / "llama-3.1-8b-shape"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_31_8B, indent=2))
    return path


def device_info() -> dict[str, Any]:
    import torch
    import triton

    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "sm_count": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def measure_copy_bandwidth(num_bytes: int = 4 * 2**30, iters: int = 20) -> float:
    """Device-to-device copy: bytes read + bytes written per second, the practical HBM ceiling."""
    import torch

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / seconds


def make_llm(model_dir: Path, args: argparse.Namespace) -> Any:
    from kvpilot.engine import LLM

    return LLM(
        model=str(model_dir),
        load_format="dummy",
        dtype="bfloat16",
        attention_backend=args.attention_backend,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        block_size=args.block_size,
        enforce_eager=args.enforce_eager,
        async_scheduling=not args.no_async_scheduling,
    )


def graph_info(llm: Any) -> dict[str, Any] | None:
    graphs = llm.engine.runner.step_graphs
    if graphs is None:
        return None
    return {
        "decode_sizes": list(graphs.decode_sizes),
        "mixed_sizes": list(graphs.mixed_sizes),
        "mixed_replays": graphs.mixed_replays,
        "capture_s": graphs.capture_s,
        "pool_mib": graphs.pool_bytes / 2**20,
        "replays": graphs.replays,
    }


def sampling(max_tokens: int) -> Any:
    from kvpilot.engine import SamplingParams

    # As vLLM's benchmark_throughput: temperature 1, every request runs to its length.
    return SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)


def warm_up(llm: Any, vocab_size: int) -> None:
    """Compiles the Triton kernels for prefill, mixed and decode shapes before anything is timed."""
    rng = np.random.default_rng(123)
    prompts = [rng.integers(0, vocab_size, n).tolist() for n in (17, 300, 1000, 64)]
    llm.generate(prompts, [sampling(n) for n in (40, 8, 4, 64)])


def decode_only_workload(batch: int, vocab_size: int) -> Workload:
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, vocab_size, 128).tolist() for _ in range(batch)]
    return Workload([128] * batch, [400] * batch, prompts)


def subset(workload: Workload, num_requests: int) -> Workload:
    n = min(num_requests, len(workload.prompts))
    return Workload(workload.input_lens[:n], workload.output_lens[:n], workload.prompts[:n])


def forget_cached_prompts(llm: Any) -> None:
    """Every part runs the same prompts: without this, a part after another would find their
    blocks in the prefix cache and skip most of its prefill."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("the prefix cache cannot be reset with requests in flight")


def run_kvpilot(llm: Any, workload: Workload) -> dict[str, Any]:
    import torch

    params = [sampling(n) for n in workload.output_lens]
    forget_cached_prompts(llm)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    if num_out != sum(workload.output_lens):
        raise RuntimeError(f"generated {num_out} tokens, asked {sum(workload.output_lens)}")
    num_in = sum(workload.input_lens)
    stats = llm.engine.stats()
    return {
        "num_requests": len(outputs),
        "elapsed_s": elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "requests_per_s": len(outputs) / elapsed,
        "num_preemptions": stats.num_preemptions,
        "num_blocks": stats.num_blocks,
        "goal_output_tokens_per_s": GOAL_OUTPUT_TOKENS_PER_S,
        "published_output_tokens_per_s": PUBLISHED_OUTPUT_TOKENS_PER_S,
    }


def run_timeline(llm: Any, workload: Workload) -> dict[str, Any]:
    """run_kvpilot under a StepTimeline: the throughput (events cost little; compare with the
    kvpilot part) and every step's composition and device time, with a summary by batch size."""
    from step_timeline import StepTimeline, format_summary, summarize, to_json

    with StepTimeline(llm.engine.core.runner) as timeline:
        run = run_kvpilot(llm, workload)
    summary = summarize(timeline.records)
    print(format_summary(summary))
    return {"run": run, "summary": summary, "steps": to_json(timeline.records)}


def run_sweep(llm: Any, workload: Workload, settings: str) -> list[dict[str, Any]]:
    """The workload once per "seqs:tokens" setting, through the same engine."""
    from dataclasses import replace

    scheduler = llm.engine.core.scheduler
    original = scheduler.config
    results = []
    try:
        for setting in settings.split(","):
            seqs, tokens = map(int, setting.split(":"))
            if seqs > original.max_num_seqs or tokens > original.max_num_batched_tokens:
                raise ValueError(f"sweep setting {setting} exceeds the engine's {original}")
            scheduler.config = replace(original, max_num_seqs=seqs, max_num_batched_tokens=tokens)
            run = run_kvpilot(llm, workload)
            tps = run["output_tokens_per_s"]
            print(f"sweep {seqs} seqs, {tokens} tokens/step: {tps:.0f} output tok/s")
            results.append({"max_num_seqs": seqs, "max_num_batched_tokens": tokens} | run)
    finally:
        scheduler.config = original
    return results


def load_engine(llm: Any, workload: Workload, warm_steps: int, tag: str) -> None:
    """Adds the whole workload (ids tag-i) and runs warm_steps steps, then waits for the device."""
    import torch

    engine = llm.engine
    forget_cached_prompts(llm)
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
        engine.add_request(f"{tag}-{i}", prompt, sampling(n))
    for _ in range(warm_steps):
        engine.step()
    torch.cuda.synchronize()


def empty_engine(llm: Any, workload: Workload, tag: str) -> None:
    """Aborts what load_engine added, so the next part starts from an empty engine."""
    engine = llm.engine
    for i in range(len(workload.prompts)):
        engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def measure_idle_fraction(
    llm: Any, workload: Workload, warm_steps: int, profiled_steps: int, tag: str = "idle"
) -> dict[str, Any]:
    """Loads the engine with the whole workload, skips warm_steps, profiles profiled_steps."""
    import torch
    from step_timeline import StepTimeline
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    load_engine(llm, workload, warm_steps, tag)
    # What the profiled steps computed (device time per token, the GEMMs' achieved FLOP rate).
    with (
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
        StepTimeline(engine.core.runner, cuda_events=False) as steps,
    ):
        for _ in range(profiled_steps):
            engine.step()
        torch.cuda.synchronize()
    intervals, starts, ends = [], [], []
    by_kernel: dict[str, list[float]] = {}
    for evt in prof.events():
        tr = evt.time_range
        starts.append(tr.start)
        ends.append(tr.end)
        if evt.device_type == torch.autograd.DeviceType.CUDA:
            intervals.append((tr.start, tr.end))
            entry = by_kernel.setdefault(evt.name[:90], [0.0, 0])
            entry[0] += (tr.end - tr.start) / 1e3
            entry[1] += 1
    busy = _union_length(intervals)
    window = max(ends) - min(starts)
    running = engine.stats().num_running
    empty_engine(llm, workload, tag)
    return {
        "profiled_steps": profiled_steps,
        "running_sequences": running,
        "window_ms": window / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_idle_fraction": 1 - busy / window,
        "launched_steps": len(steps.records),
        "decode_tokens": sum(r.decode_rows for r in steps.records),
        "prefill_tokens": sum(r.prefill_tokens for r in steps.records),
        "context_tokens": sum(r.context_tokens for r in steps.records),
        # Where the busy time goes: device time per kernel name over the profiled steps.
        "top_kernels": [
            {"name": name, "ms": round(ms, 3), "launches": count}
            for name, (ms, count) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:40]
        ],
    }


def profile_host(
    llm: Any, workload: Workload, warm_steps: int, steps: int, top: int = 25
) -> dict[str, Any]:
    """cProfile of the host over `steps` steady steps under the whole workload (no torch
    profiler, whose per-op recording would inflate the host side): wall ms per step and the
    functions with the most own time."""
    import cProfile
    import pstats

    import torch

    engine = llm.engine
    load_engine(llm, workload, warm_steps, "host")
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - started) * 1e3
    running = engine.stats().num_running
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    functions = [
        {
            "function": f"{Path(file).name}:{line}({name})",
            "calls": calls,
            "own_ms_per_step": own * 1e3 / steps,
            "cumulative_ms_per_step": cumulative * 1e3 / steps,
        }
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]
    empty_engine(llm, workload, "host")
    return {
        "steps": steps,
        "running_sequences": running,
        "wall_ms_per_step_under_cprofile": wall_ms / steps,
        "top_functions_by_own_time": functions,
    }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def run_single_stream(llm: Any, prompt_len: int, output_len: int) -> dict[str, Any]:
    from kvpilot.engine.config import ModelConfig

    rng = np.random.default_rng(7)
    cfg = ModelConfig.from_hf_config(LLAMA_31_8B)
    prompt = rng.integers(0, cfg.vocab_size, prompt_len).tolist()
    out = llm.generate([prompt], sampling(output_len))[0]
    m = out.metrics
    decode_s = m.finished_time - m.first_token_time
    decode_tps = (len(out.outputs[0].token_ids) - 1) / decode_s
    weight_bytes = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    mean_context = prompt_len + output_len / 2
    kv_bytes = cfg.kv_bytes_per_token * 2 * mean_context  # bf16: 2 bytes per element
    bandwidth = measure_copy_bandwidth()
    roofline = bandwidth / (weight_bytes + kv_bytes)
    return {
        "prompt_len": prompt_len,
        "output_len": output_len,
        "decode_tokens_per_s": decode_tps,
        "ttft_s": m.first_token_time - m.arrival_time,
        "weight_gb": weight_bytes / 1e9,
        "kv_gb_per_token_at_mean_context": kv_bytes / 1e9,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "roofline_tokens_per_s": roofline,
        "fraction_of_roofline": decode_tps / roofline,
        "goal_fraction": 0.85,
    }


def run_transformers(workload: Workload, batch_size: int, num_requests: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in LLAMA_31_8B.items() if k != "architectures"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(
            config, dtype=torch.bfloat16, attn_implementation="sdpa"
        ).eval()
    requested = generated = 0
    subset = range(min(num_requests, len(workload.prompts)))
    batches = [list(subset[i : i + batch_size]) for i in range(0, len(subset), batch_size)]
    pad = 0
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            prompts = [workload.prompts[i] for i in batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device="cuda")
            mask = torch.tensor(
                [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda"
            )
            new = max(workload.output_lens[i] for i in batch)
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                eos_token_id=None,
                pad_token_id=pad,
            )
            generated += (out.shape[1] - width) * len(batch)
            requested += sum(workload.output_lens[i] for i in batch)
            print(f"transformers: {requested} tokens in {time.perf_counter() - start:.1f} s")
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {
        "num_requests": len(subset),
        "batch_size": batch_size,
        "elapsed_s": elapsed,
        "output_tokens_per_s": requested / elapsed,
        "generated_tokens_per_s_including_padding_waste": generated / elapsed,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", default="kvpilot,idle,single,hf")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attention-backend", default="triton", choices=("triton", "torch"))
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument(
        "--no-async-scheduling",
        action="store_true",
        help="steps in turn: read each step's tokens before scheduling the next",
    )
    p.add_argument("--subset-requests", type=int, default=200)
    p.add_argument(
        "--sweep",
        default="512:4096,512:2048,384:8192",
        help="the sweep part's max_num_seqs:max_num_batched_tokens settings, comma-separated",
    )
    p.add_argument("--idle-decode-batches", default="1,16,64")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--idle-warm-steps", type=int, default=60)
    p.add_argument("--idle-profiled-steps", type=int, default=30)
    p.add_argument("--single-prompt-len", type=int, default=128)
    p.add_argument("--single-output-len", type=int, default=512)
    p.add_argument("--hf-batch-size", type=int, default=64)
    p.add_argument("--hf-num-requests", type=int, default=256)
    p.add_argument("--out", type=Path, default=Path("bench/out/gpu_offline_throughput.json"))
    p.add_argument(
        "--workload-only", action="store_true", help="print the workload statistics and exit (CPU)"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    workload = build_workload(args.num_requests, LLAMA_31_8B["vocab_size"], args.seed)
    result: dict[str, Any] = {
        "workload": workload.stats(),
        "args": vars(args) | {"out": str(args.out)},
    }
    if args.workload_only:
        print(json.dumps(result["workload"], indent=2))
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            "this benchmark needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr
        )
        return 2
    parts = set(args.parts.split(","))
    unknown = parts - PARTS
    if unknown:
        print(f"unknown parts: {sorted(unknown)}", file=sys.stderr)
        return 2
    result["device"] = device_info()

    def save() -> None:  # after every part: a run cut short still leaves what it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2, default=str))

    command = "python bench/gpu_offline_throughput.py " + " ".join(sys.argv[1:])
    result["command"] = command
    if parts & (PARTS - {"hf"}):  # all but transformers run kvpilot's engine
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            llm = make_llm(write_model_dir(Path(tmp)), args)
            result["engine_start_s"] = time.perf_counter() - started
            print(f"engine started in {result['engine_start_s']:.1f} s", flush=True)
            from kvpilot.engine.kernels.runtime import compiled_variants

            # Triton variants compiled so far: unchanged after start-up means no step waited.
            compiles = result["triton_variants_compiled"] = {}

            def note_compiles(after: str) -> None:
                compiles[after] = sum(compiled_variants().values())

            note_compiles("start")
            warm_up(llm, LLAMA_31_8B["vocab_size"])
            note_compiles("warm_up")
            if "subset" in parts:
                result["kvpilot_subset"] = run_kvpilot(llm, subset(workload, args.subset_requests))
                tps = result["kvpilot_subset"]["output_tokens_per_s"]
                print(f"kvpilot, first {args.subset_requests} requests: {tps:.0f} output tok/s")
                save()
            if "kvpilot" in parts:
                result["kvpilot"] = run_kvpilot(llm, workload)
                print(f"kvpilot: {result['kvpilot']['output_tokens_per_s']:.0f} output tok/s")
                note_compiles("kvpilot")
                save()
            if "sweep" in parts:
                result["sweep"] = run_sweep(llm, workload, args.sweep)
                note_compiles("sweep")
                save()
            if "timeline" in parts:
                result["timeline"] = run_timeline(llm, workload)
                tps = result["timeline"]["run"]["output_tokens_per_s"]
                print(f"kvpilot under the step timeline: {tps:.0f} output tok/s")
                note_compiles("timeline")
                save()
            if "idle" in parts:
                result["idle"] = measure_idle_fraction(
                    llm, workload, args.idle_warm_steps, args.idle_profiled_steps
                )
                print(f"GPU idle fraction under load: {result['idle']['gpu_idle_fraction']:.1%}")
                save()
            if "host" in parts:
                result["host"] = profile_host(
                    llm, workload, args.idle_warm_steps, args.idle_profiled_steps
                )
                for row in result["host"]["top_functions_by_own_time"][:12]:
                    print(f"host: {row['own_ms_per_step']:6.2f} ms/step  {row['function']}")
                save()
            if "idle_decode" in parts:
                result["idle_decode"] = {}
                for batch in map(int, args.idle_decode_batches.split(",")):
                    decode = decode_only_workload(batch, LLAMA_31_8B["vocab_size"])
                    # One prefill step takes every prompt (batch * 128 <= the token budget).
                    idle = measure_idle_fraction(
                        llm, decode, 3, args.idle_profiled_steps, tag=f"decode{batch}"
                    )
                    result["idle_decode"][batch] = idle
                    fraction = idle["gpu_idle_fraction"]
                    print(f"GPU idle fraction, decode batch {batch}: {fraction:.1%}")
                save()
            if "single" in parts:
                result["single_stream"] = run_single_stream(
                    llm, args.single_prompt_len, args.single_output_len
                )
                s = result["single_stream"]
                print(
                    f"single stream: {s['decode_tokens_per_s']:.1f} tok/s, "
                    f"{s['fraction_of_roofline']:.1%} of {s['roofline_tokens_per_s']:.1f} roofline"
                )
            result["cuda_graphs"] = graph_info(llm)
            del llm
            gc.collect()
            torch.cuda.empty_cache()
    if "hf" in parts:
        result["transformers"] = run_transformers(
            workload, args.hf_batch_size, args.hf_num_requests
        )
        hf = result["transformers"]["output_tokens_per_s"]
        print(f"transformers (static batches of {args.hf_batch_size}): {hf:.0f} output tok/s")
        if "kvpilot" in result:
            result["kvpilot_over_transformers"] = result["kvpilot"]["output_tokens_per_s"] / hf
    save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
