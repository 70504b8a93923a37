"""The API process's output processing per token as outputs grow: cumulative snapshots against
DELTA outputs (what the server's streams get).

A cumulative output copies a sequence's token list (and logprobs) every step, O(length) per token;
a DELTA output holds only the step's token. This feeds the same hand-made steps (the bundled
SmolLM2 tokenizer, random token ids, `--batch` sequences, one token each per step) through
`OutputProcessor` (detokenizing, the outputs) once per kind, in alternating rounds, and prints the
median microseconds per token in bands of output position.

    python bench/output_processor_bench.py --length 8192 --batch 16 --rounds 3
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kvpilot.engine.core.messages import EngineStats, SeqUpdate, StepOutputs
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path, load_tokenizer
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import OutputKind
from kvpilot.engine.sampling_params import SamplingParams

KINDS = (OutputKind.CUMULATIVE, OutputKind.DELTA)


def seconds_per_step(tokenizer: object, kind: OutputKind, length: int, batch: int) -> list[float]:
    rng = random.Random(0)
    processor = OutputProcessor(tokenizer)
    params = SamplingParams(max_tokens=length, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(128)]
        processor.add_request(f"r{i}", None, prompt, params, 0.0, kind=kind)
    stats = EngineStats(0, batch, 0.1, 100, 32, 0, 0, 0, 0, 0)
    times = []
    for position in range(length):
        finish = "length" if position == length - 1 else None
        updates = [
            SeqUpdate(f"r{i}", 0, rng.randrange(100, 40000), None, finish) for i in range(batch)
        ]
        step = StepOutputs(updates, stats, 0, token_time=float(position))
        start = time.perf_counter()
        processor.process(step)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=8192, help="output tokens per sequence")
    ap.add_argument("--batch", type=int, default=16, help="sequences, each one token per step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bands", type=int, default=8)
    args = ap.parse_args()
    tokenizer = load_tokenizer(gguf_to_hf_dir(bundled_gguf_path()))
    runs: dict[OutputKind, list[list[float]]] = {kind: [] for kind in KINDS}
    for r in range(args.rounds):
        for kind in KINDS if r % 2 == 0 else reversed(KINDS):
            runs[kind].append(seconds_per_step(tokenizer, kind, args.length, args.batch))
    band = args.length // args.bands
    print(
        f"output processing, {args.batch} sequences, us per token (median of {args.rounds} rounds)"
    )
    print(f"{'positions':>14}" + "".join(f"{kind.value:>12}" for kind in KINDS))
    for lo in range(0, band * args.bands, band):
        cells = []
        for kind in KINDS:
            per_round = [sum(times[lo : lo + band]) / band / args.batch for times in runs[kind]]
            cells.append(f"{statistics.median(per_round) * 1e6:>12.1f}")
        print(f"{lo:>6}-{lo + band:<7}" + "".join(cells))


if __name__ == "__main__":
    main()
