"""What one engine step costs by the tokens in it: the time of a request with a prompt of N tokens
and max_tokens 1 (one prefill step of N tokens, plus the fixed cost of a request), on the bundled
SmolLM2 in float32 with one torch thread, as bench/tenancy.py's engine runs. It is the cost model
behind the priority guard's bound on worse tokens per step (engine/config.py,
DEFAULT_GUARD_STEP_TOKENS): what a better request arriving mid-step waits for beyond its own
class's work is the worse tokens in that step.

    python bench/step_cost.py            # ~1 min; bench/step_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,4,8,16,32,64", help="prompt lengths to time")
    parser.add_argument("--repeats", type=int, default=7, help="requests per length per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=BENCH / "step_cost.json")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(dtype="float32", enable_prefix_caching=False)
    params = SamplingParams(max_tokens=1)
    lengths = [int(n) for n in args.tokens.split(",")]
    rounds: list[dict[str, float]] = []
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        medians: dict[str, float] = {}
        for n in lengths:
            times = []
            for k in range(args.repeats):
                prompt = [100 + (k * 7 + i) % 500 for i in range(n)]  # no prefix shared
                started = time.perf_counter()
                llm.generate([prompt], params)
                times.append(time.perf_counter() - started)
            medians[str(n)] = round(1000 * statistics.median(times), 1)
        rounds.append(medians)
        print(medians, flush=True)
        load.append(os.getloadavg()[0])
    per_length = {str(n): round(statistics.median(r[str(n)] for r in rounds), 1) for n in lengths}
    first, last = lengths[0], lengths[-1]
    per_token = (per_length[str(last)] - per_length[str(first)]) / (last - first)
    result = {
        "command": "python bench/step_cost.py",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "load_average_1m": load,
        "request_ms_by_prompt_tokens": per_length,
        "rounds": rounds,
        "ms_per_token": round(per_token, 2),
        "ms_fixed": round(per_length[str(first)] - first * per_token, 1),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
