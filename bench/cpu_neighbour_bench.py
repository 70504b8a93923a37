"""Offline throughput with a bursty CPU neighbour: how much a kernel variant loses when another
process takes short slices of the cores, A/B against the linear kernel as the engine builds it.

While serving, the API process (detokenizing, streaming) and the clients wake after every step and
take a few milliseconds of a core that the engine core's two OpenMP threads were using. A parallel
region whose work is split statically then waits for the preempted thread: the whole call stalls
for the neighbour's slice. This measures it without HTTP in the way: one engine (SmolLM2, block
size 32, batch = --batch) runs serve_bench's peer requests offline, alternating between the linear
kernel the engine built and the same source built with `--variant-flags` (swapped in the packed
layers, whose layout is the same), each quiet and then beside a neighbour process that spins for
--burst-ms every --period-ms.

    python bench/cpu_neighbour_bench.py --dtype bfloat16 --batch 64
    python bench/cpu_neighbour_bench.py --variant-flags=-DSOME_MACRO --burst-ms 4 --period-ms 160
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.cpu.build import SUFFIXES, load_library
from kvpilot.engine.cpu.linear import KernelLinear

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench


def neighbour(burst_s: float, period_s: float) -> None:
    """Spin for burst_s, sleep out the rest of period_s, forever (killed by the parent)."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < burst_s:
            pass
        time.sleep(max(0.0, period_s - (time.perf_counter() - start)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every variant twice")
    ap.add_argument("--burst-ms", type=float, default=8.0)
    ap.add_argument("--period-ms", type=float, default=40.0)
    ap.add_argument(
        "--variant-flags",
        default="-DKVPILOT_LINEAR_STATIC",
        help="compiler flags of the library whose linear kernel is compared with the engine's",
    )
    ap.add_argument("--neighbour", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.neighbour:
        neighbour(args.burst_ms / 1e3, args.period_ms / 1e3)
        return
    variant = f"with {args.variant_flags}"
    libs = {"engine": load_library(), variant: load_library(tuple(args.variant_flags.split()))}
    if any(lib is None for lib in libs.values()):
        raise SystemExit("no C compiler: the kernels cannot be built here")
    llm = LLM(dtype=args.dtype, block_size=32, max_num_seqs=args.batch, max_num_batched_tokens=2048)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, KernelLinear)]
    if not layers:
        raise SystemExit(f"no layer runs the linear kernel in {args.dtype} on this CPU")
    kernel_name = f"linear_{SUFFIXES[layers[0].packed_weight.dtype]}"
    bench_args = serve_bench.build_parser().parse_args(["--output-len", "64"])

    def requests(seed: int) -> tuple[list[list[int]], list[SamplingParams]]:
        prompts, lengths = serve_bench.prompts_and_lengths(
            bench_args, serve_bench.peer_dataset(bench_args, seed)
        )
        ids = [list(llm.tokenizer.encode(p)) for p in prompts]
        return ids, [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths
        ]

    warm_ids, _ = requests(99)
    llm.generate(
        warm_ids[: args.batch], [SamplingParams(max_tokens=8, ignore_eos=True)] * args.batch
    )
    neighbour_cmd = [sys.executable, __file__, "--neighbour", "--burst-ms", str(args.burst_ms),
                     "--period-ms", str(args.period_ms)]  # fmt: skip
    results: dict[tuple[str, bool], list[float]] = {}
    names = list(libs)
    print(f"{args.dtype}, batch {args.batch}, {len(layers)} kernel layers; neighbour: "
          f"{args.burst_ms:g} ms busy every {args.period_ms:g} ms", flush=True)  # fmt: skip
    for r in range(args.rounds):
        ids, params = requests(r)
        for name in names if r % 2 == 0 else names[::-1]:
            for layer in layers:
                layer._kernel = getattr(libs[name], kernel_name)
            for noisy in (False, True):
                llm.reset_prefix_cache()
                proc = subprocess.Popen(neighbour_cmd) if noisy else None
                try:
                    time.sleep(0.3)
                    start = time.perf_counter()
                    out = llm.generate(ids, params)
                    seconds = time.perf_counter() - start
                finally:
                    if proc is not None:
                        proc.kill()
                        proc.wait()
                tokens = sum(len(o.outputs[0].token_ids) for o in out)
                results.setdefault((name, noisy), []).append(tokens / seconds)
                label = "beside the neighbour" if noisy else "quiet"
                print(f"  round {r + 1} {name:>32} {label:>21}: {tokens / seconds:6.1f} tok/s",
                      flush=True)  # fmt: skip
    print("medians:")
    for name in names:
        quiet = statistics.median(results[(name, False)])
        noisy = statistics.median(results[(name, True)])
        print(f"  {name:>32}: quiet {quiet:6.1f} tok/s, beside the neighbour {noisy:6.1f} tok/s "
              f"(loses {1 - noisy / quiet:.1%})")  # fmt: skip


if __name__ == "__main__":
    main()
