"""kvpilot's CPU linear kernel (engine/cpu/linear.py) against oneDNN's packed linear, inside the
engine: two offline LLMs in one process, identical but for the linears, running the same
requests in turns.

Prefill (the default, --max-tokens 1): 64 prompts of 100-200 random token ids, prefix caching off,
so every run prefills ~9,600 tokens in 2048-token steps: the linears at their largest M. With
--max-tokens N and --max-num-seqs B, decode steps of up to B rows dominate instead.

    python bench/cpu_linear_ab.py --dtype bfloat16 --rounds 5
    python bench/cpu_linear_ab.py --dtype float32 --max-tokens 64 --max-num-seqs 16
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections.abc import Iterator

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu import linear


@contextlib.contextmanager
def onednn_linears() -> Iterator[None]:
    """LLMs built inside pack their linears for oneDNN, as the runner does where the kernel is
    absent."""
    use_kernel = linear.use_kernel_linears
    linear.use_kernel_linears = lambda *_: 0
    try:
        yield
    finally:
        linear.use_kernel_linears = use_kernel


def build(dtype: str, kernel: bool, max_num_seqs: int) -> LLM:
    """An LLM with kvpilot's kernel, or (kernel=False) with the linears on oneDNN."""
    with contextlib.nullcontext() if kernel else onednn_linears():
        return LLM(
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=2048,
            enable_prefix_caching=False,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5, help="runs per variant; the first unmeasured")
    ap.add_argument("--max-tokens", type=int, default=1, help="output tokens per request")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=64)
    args = ap.parse_args()
    llms = {
        "kvpilot kernel": build(args.dtype, True, args.max_num_seqs),
        "oneDNN packed": build(args.dtype, False, args.max_num_seqs),
    }
    kinds = {
        label: type(llm.engine.runner.model.model.layers[0].mlp.down_proj).__name__
        for label, llm in llms.items()
    }
    assert kinds == {"kvpilot kernel": "KernelLinear", "oneDNN packed": "PackedLinear"}, kinds
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 40000) for _ in range(rng.randrange(100, 200))]
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    seconds: dict[str, list[float]] = {label: [] for label in llms}
    for _ in range(args.rounds):
        for label, llm in llms.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            seconds[label].append(time.perf_counter() - start)
    prompt_tokens = sum(map(len, prompts))
    output_tokens = args.max_tokens * len(prompts)
    print(
        f"{args.dtype}, {len(prompts)} prompts ({prompt_tokens} tokens), {args.max_tokens} output "
        f"tokens each, max_num_seqs {args.max_num_seqs}"
    )
    medians = {label: statistics.median(runs[1:]) for label, runs in seconds.items()}
    for label, median in medians.items():
        runs = ", ".join(f"{s:.2f}" for s in seconds[label])
        print(
            f"  {label:15s} {median:6.2f} s: {prompt_tokens / median:7.0f} prompt tok/s, "
            f"{output_tokens / median:6.1f} output tok/s (runs: {runs} s)"
        )
    ratio = medians["oneDNN packed"] / medians["kvpilot kernel"]
    print(f"  kernel / oneDNN speed: {ratio:.3f}x")


if __name__ == "__main__":
    main()
