"""CPU lists and CPU quotas: the form `--engine-cpus` takes (that of taskset, cpusets and /proc's
Cpus_allowed_list) and the whole CPUs a quota holds. The engine places its processes by these
rules (kvpilot.engine.cpu.affinity) and the operator checks `--api-cpus` against a pod's CPU
limit with them."""

from __future__ import annotations

import math
from collections.abc import Iterable

# Far above any machine's CPU count: a typo such as "0-40000" is an error, not a huge set.
MAX_CPU_ID = 16383


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """ "0-3,6" -> (0, 1, 2, 3, 6), the form of taskset, cpusets and /proc's Cpus_allowed_list;
    sorted, each CPU once. ValueError with the reason for anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        first, dash, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if dash else lo
        except ValueError:
            raise ValueError(f"{part!r} is not a CPU number or range (the form is 0-3,6)") from None
        if lo < 0 or hi < 0:
            raise ValueError(f"{part!r}: CPU numbers are >= 0")
        if hi < lo:
            raise ValueError(f"{part!r}: a range goes from low to high")
        if hi > MAX_CPU_ID:
            raise ValueError(f"{part!r}: CPU numbers are at most {MAX_CPU_ID}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5" (parse_cpu_list's form)."""
    spans: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def whole_cpus(quota: float) -> int:
    """The whole CPUs of a CPU quota (at least one): the threads that fit it."""
    return max(1, math.floor(quota))
