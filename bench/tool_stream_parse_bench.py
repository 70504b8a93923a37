"""The cost per streamed step of reading tool calls out of a growing text, as the text grows.

A chat stream with tools re-parses its choice's text every step to find the calls' names and
argument fragments (engine/server/tools). A call whose arguments are long (a file written
through a tool: code inside a JSON string) made that a re-read of the whole text per token,
quadratic over the call. This feeds one Hermes call with a long `content` argument through
`tool_deltas`, a few characters per step (about a token), and prints the median microseconds per
step around each length: with the stream's scan memo (what the server does) and, where this
checkout has one, re-scanning the whole text each step (memo off), in alternating rounds.

    python bench/tool_stream_parse_bench.py --lengths 1000,4000,16000,64000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvpilot.engine.server.tools import render
from kvpilot.engine.server.tools.parsers import HermesParser

CHARS_PER_STEP = 4  # about one token of code
STEPS_TIMED = 200


def call_text(length: int) -> str:
    """A Hermes tool call at least `length` characters long: code with quotes, backslashes and
    brackets inside a JSON string, the way a model writes a file through a tool."""
    line = 'def f(x):\n    return "a\\\\b" + str(x)  # {[ ]}\n'
    code = line * (length // len(line) + 1)
    body = json.dumps({"name": "write_file", "arguments": {"path": "f.py", "content": code}})
    return f"Writing it.\n<tool_call>\n{body}\n</tool_call>"


def us_per_step(text: str, at: int, memo: bool) -> float:
    """Stream the text up to `at` in one step, then time STEPS_TIMED steps of CHARS_PER_STEP;
    memo False forgets the stream's scans before every step (a checkout without a memo always
    re-reads the whole text)."""
    parser = HermesParser()
    cursor = render.ToolStreamCursor()
    render.tool_deltas(cursor, parser, text[:at], final=False, max_calls=None)
    forget = not memo and hasattr(cursor, "memo")
    elapsed = 0.0
    for k in range(1, STEPS_TIMED + 1):
        if forget:
            cursor.memo = type(cursor.memo)()
        end = at + k * CHARS_PER_STEP
        start = time.perf_counter()
        render.tool_deltas(cursor, parser, text[:end], final=False, max_calls=None)
        elapsed += time.perf_counter() - start
    return elapsed / STEPS_TIMED * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="1000,4000,16000,64000")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    text = call_text(max(lengths) + CHARS_PER_STEP * STEPS_TIMED + 100)
    has_memo = hasattr(render.ToolStreamCursor(), "memo")
    modes = ["memo", "rescan"] if has_memo else ["rescan"]
    print(f"{'text chars':>10}  " + "  ".join(f"{m + ' us/step':>16}" for m in modes), flush=True)
    for length in lengths:
        samples: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode in modes if r % 2 == 0 else modes[::-1]:
                samples[mode].append(us_per_step(text, length, mode == "memo"))
        row = "  ".join(f"{statistics.median(samples[m]):16.1f}" for m in modes)
        print(f"{length:>10}  {row}", flush=True)


if __name__ == "__main__":
    main()
