"""Run `kvpilot router` under cProfile on a CPU clock, profiling only between two signals.

    python bench/common/router_profile.py STATS_PATH -- router --static m=http://... --port 0

SIGUSR1 starts profiling; SIGUSR2 stops it and writes the stats (pstats format) to STATS_PATH.
The clock is time.process_time, so time spent waiting on the network or for a CPU (a busy
machine) is not counted: what is left is the router process's own CPU, by function.
`bench/router_chat.py --profile STATS_PATH` starts the router this way around its overhead
requests; read the result with `python -m pstats STATS_PATH` or `--print STATS_PATH`.
"""

from __future__ import annotations

import cProfile
import pstats
import signal
import sys
import time
from types import FrameType


def install(path: str) -> None:
    profiler = cProfile.Profile(time.process_time)

    def start(_: int, __: FrameType | None) -> None:
        profiler.enable()

    def stop(_: int, __: FrameType | None) -> None:
        profiler.disable()
        profiler.dump_stats(path)

    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)


def show(path: str, limit: int = 45) -> None:
    stats = pstats.Stats(path)
    stats.sort_stats("tottime").print_stats(limit)
    stats.sort_stats("cumulative").print_stats(limit)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--print":
        show(sys.argv[2])
        return 0
    if len(sys.argv) < 3 or sys.argv[2] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    install(sys.argv[1])
    from kvpilot.cli import main as cli_main

    sys.argv = ["kvpilot", *sys.argv[3:]]
    return cli_main()


if __name__ == "__main__":
    sys.exit(main())
