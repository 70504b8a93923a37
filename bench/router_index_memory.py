"""Bytes the router's block index takes per cached block: one BlockIndex filled with N random
64-bit block hashes (as engines report them), measured with tracemalloc.

    python bench/router_index_memory.py --blocks 1000000
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc

from kvpilot.router.index import BlockIndex


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    rng = random.Random(0)
    hashes = [rng.getrandbits(64) for _ in range(args.blocks)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = BlockIndex(max_blocks=args.blocks)
    index.reset(hashes)  # the int objects are shared with `hashes`: counted separately below
    set_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    int_bytes = sum(h.__sizeof__() for h in hashes[:1000]) / 1000 * args.blocks
    chain = hashes[:128]
    started = time.perf_counter()
    for _ in range(1000):
        index.matched_blocks(chain)
    match_us = (time.perf_counter() - started) / 1000 * 1e6
    per_million = (set_bytes + int_bytes) / args.blocks * 1e6
    print(
        f"{args.blocks} blocks: set {set_bytes / 2**20:.1f} MiB + hash ints "
        f"{int_bytes / 2**20:.1f} MiB = {per_million / 2**20:.1f} MiB per million blocks "
        f"({(set_bytes + int_bytes) / args.blocks:.0f} B/block); longest-run match of a "
        f"128-block chain: {match_us:.1f} us"
    )


if __name__ == "__main__":
    main()
