"""The engine's host work per decode step at large batches, with a model too small to matter.

On a GPU the host work of a step (scheduling, block tables, step inputs, sampling calls, output
processing) is time the GPU waits for: on an H200 at 256 running requests the GPU idled 46% of
each 26 ms step (bench/RESULTS.md, "On a GPU: NVIDIA H200"). Here a 2-layer, 64-wide dummy Llama
makes the forward cost little, so the step time is mostly that host work, measurable on a CPU.

Steady decode: `batch` requests of 100 prompt tokens decode greedily (ignore_eos); after a warm-up
the median over --steps steps is reported, for requests whose every step returns a cumulative
snapshot (OutputKind.CUMULATIVE), only what the step added (DELTA, as the server's streams get
them), or nothing until they finish (FINAL_ONLY, as LLM.generate adds them), in turns. --profile
prints cProfile's top functions of one final-only run.

    python bench/host_step_overhead.py --batch 64 256 --steps 80 --rounds 5
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.outputs import OutputKind

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 1024,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
}


def step_ms(llm: LLM, batch: int, steps: int, kind: OutputKind, tag: str) -> list[float]:
    engine = llm.engine
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 50, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(TINY_LLAMA["vocab_size"], (100,), generator=gen).tolist()
        engine.add_request(f"{tag}-{i}", prompt, params, kind=kind)
    for _ in range(5):  # the prefills, then a few decodes
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    for i in range(batch):
        engine.abort_request(f"{tag}-{i}")
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: less jitter)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = Path(tempfile.mkdtemp()) / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    llm = LLM(
        model=str(model_dir),
        load_format="dummy",
        max_num_seqs=max(args.batch),
        max_num_batched_tokens=8192,
        kv_cache_gib=1.0,
    )
    print(f"tiny dummy Llama (2 layers, hidden 64), {torch.get_num_threads()} threads, greedy")
    kinds = list(OutputKind)
    heads = "".join(f"{kind.value + ' ms':>15}" for kind in kinds)
    print(f"{'batch':>6}{heads}  (medians of rounds' medians)")
    for batch in args.batch:
        step_ms(llm, batch, 5, OutputKind.FINAL_ONLY, "warm")
        medians: dict[OutputKind, list[float]] = {kind: [] for kind in kinds}
        for r in range(args.rounds):
            for kind in kinds:
                times = step_ms(llm, batch, args.steps, kind, f"{kind.value}-{r}")
                medians[kind].append(statistics.median(times))
        cells = "".join(f"{statistics.median(medians[kind]):>15.2f}" for kind in kinds)
        print(f"{batch:>6}{cells}")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        step_ms(llm, max(args.batch), args.steps, OutputKind.FINAL_ONLY, "prof")
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
