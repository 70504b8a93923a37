"""Which CPUs the engine core computes on, and which are left to the API process.

By default the engine core's intra-op threads and the API process (HTTP, tokenization,
detokenization, SSE) share every CPU the pod may use: on a small pod that is the most compute for
the model, and the API process's few percent of the CPUs preempt a compute thread now and then
(a step waits for its slowest thread). `kvpilot serve --engine-cpus LIST` binds the engine core
(and its tensor-parallel ranks, which it starts) to LIST, one intra-op thread per CPU, and the API
process to the other CPUs; `--api-cpus N` leaves the API process N of the CPUs the pod was given,
whichever they are (a Kubernetes pod does not know its CPU numbers in advance). No step then
waits for HTTP work, as with vLLM's VLLM_CPU_OMP_THREADS_BIND and its CPUs reserved for the
frontend. Worth it where the API process's load is a real part of a CPU (a fast engine, many
streams) or latency must not jitter; on 2 CPUs it halves the engine (bench/serve_vs_offline.py,
bench/RESULTS.md).

The CPU-list form and the whole CPUs of a quota are the rules `kvpilot serve`'s flags (which the
operator checks) share with it: kvpilot.contract.cpus.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvpilot.contract.cpus import format_cpu_list, whole_cpus


@dataclass(frozen=True)
class CpuPlacement:
    """Where the engine core and the API process run: their CPUs (None: not bound, every CPU
    this process may use) and the engine core's intra-op threads."""

    engine: tuple[int, ...] | None
    api: tuple[int, ...] | None
    engine_threads: int

    def describe(self) -> str:
        threads = f"{self.engine_threads} intra-op threads"
        if self.engine is None:
            return f"engine core: {threads} (under a CPU quota: no CPUs of its own to bind)"
        api = format_cpu_list(self.api) if self.api else "the same CPUs (none left over)"
        engine = format_cpu_list(self.engine)
        return f"engine core on CPUs {engine}, {threads}; API process on {api}"


def place(
    allowed: Iterable[int],
    quota: float | None,
    environ: Mapping[str, str],
    *,
    engine_cpus: tuple[int, ...] | None = None,
    api_cpus: int | None = None,
) -> CpuPlacement | None:
    """The placement --engine-cpus or --api-cpus asks for (None for neither), among the CPUs
    this process may use (`allowed`) under its cgroup CPU quota (None: none). ValueError, with
    this process's CPUs, for a placement they cannot hold.

    --engine-cpus LIST: the engine core on LIST, the API process on the others (when none is
    left over, it shares the engine's, as without the flag). --api-cpus N: the API process keeps
    the last N CPUs, the engine core the rest; under a quota smaller than the CPUs it may run on
    (CPUs shared with other pods, nothing to bind), the engine core takes N fewer threads than
    the quota's whole CPUs. Threads: one per engine CPU, never more than the quota's whole CPUs;
    OMP_NUM_THREADS in `environ` wins."""
    allowed_set = set(allowed)
    whole_quota = whole_cpus(quota) if quota is not None else None
    if engine_cpus is not None and api_cpus is not None:
        raise ValueError("give --engine-cpus or --api-cpus, not both")
    if engine_cpus is not None:
        if not engine_cpus:
            raise ValueError("--engine-cpus names no CPU")
        foreign = [cpu for cpu in engine_cpus if cpu not in allowed_set]
        if foreign:
            raise ValueError(
                f"--engine-cpus {format_cpu_list(engine_cpus)}: CPU(s) {format_cpu_list(foreign)} "
                f"are not among this process's CPUs {format_cpu_list(allowed_set)}"
            )
        engine = tuple(sorted(engine_cpus))
    elif api_cpus is not None:
        if api_cpus < 1:
            raise ValueError(f"--api-cpus must be >= 1, got {api_cpus}")
        if whole_quota is not None and whole_quota < len(allowed_set):
            if api_cpus >= whole_quota:
                raise ValueError(
                    f"--api-cpus {api_cpus} leaves the engine core no CPU: this process's CPU "
                    f"quota is {quota:g} CPUs"
                )
            threads = given_threads(environ) or whole_quota - api_cpus
            return CpuPlacement(engine=None, api=None, engine_threads=threads)
        if api_cpus >= len(allowed_set):
            raise ValueError(
                f"--api-cpus {api_cpus} leaves the engine core no CPU: this process may use "
                f"{len(allowed_set)} CPU(s), {format_cpu_list(allowed_set)}"
            )
        engine = tuple(sorted(allowed_set))[: len(allowed_set) - api_cpus]
    else:
        return None
    rest = tuple(sorted(allowed_set - set(engine)))
    threads = given_threads(environ) or min(len(engine), whole_quota or len(engine))
    return CpuPlacement(engine=engine, api=rest or None, engine_threads=threads)


def given_threads(environ: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS when it is set to a positive count (torch reads it so)."""
    given = environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else None


def bind_this_process(cpus: Iterable[int], task_dir: Path = Path("/proc/self/task")) -> int:
    """Binds every thread this process has now to `cpus` (threads started later inherit their
    starter's CPUs); returns how many it bound. os.sched_setaffinity(0, ...) would bind the
    calling thread alone, and the others (ZMQ's I/O threads, the output thread) would stay."""
    mask = set(cpus)
    bound = 0
    for task in task_dir.iterdir():
        try:
            os.sched_setaffinity(int(task.name), mask)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        bound += 1
    return bound
