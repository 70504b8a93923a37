"""Intra-op threads that fit the container's CPU quota.

torch (through OpenMP) starts one intra-op thread per CPU it can run on, and a Kubernetes CPU limit
is not an affinity mask but a CFS quota: a pod limited to 4 CPUs on a 64-core node gets 64 threads
that the kernel throttles in turn, and every step waits for the slowest of them. `kvpilot serve`
therefore caps torch's threads at the quota, unless OMP_NUM_THREADS says otherwise.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvpilot.contract.cpus import whole_cpus

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 mounts the cpu controller under one of these names.
CGROUP_V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def cpu_limit_v2(cpu_max: str) -> float | None:
    """CPUs allowed by a cgroup v2 `cpu.max` ("QUOTA PERIOD", QUOTA "max" when unlimited)."""
    fields = cpu_max.split()
    if len(fields) != 2 or fields[0] == "max":
        return None
    quota, period = int(fields[0]), int(fields[1])
    return quota / period if quota > 0 and period > 0 else None


def cpu_limit_v1(cfs_quota_us: str, cfs_period_us: str) -> float | None:
    """CPUs allowed by cgroup v1 `cpu.cfs_quota_us` (-1 when unlimited) and `cpu.cfs_period_us`."""
    quota, period = int(cfs_quota_us), int(cfs_period_us)
    return quota / period if quota > 0 and period > 0 else None


def read_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup (as a container sees its own), or None."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            return cpu_limit_v2(v2.read_text())
        for name in CGROUP_V1_CPU_DIRS:
            quota = root / name / "cpu.cfs_quota_us"
            if quota.is_file():
                period = (root / name / "cpu.cfs_period_us").read_text()
                return cpu_limit_v1(quota.read_text(), period)
    except (OSError, ValueError):
        log.debug("could not read the cgroup CPU quota under %s", root, exc_info=True)
    return None


def threads_for_limit(current: int, limit: float | None) -> int:
    """At most the whole CPUs of the quota (at least one); never more than `current`."""
    if limit is None:
        return current
    return min(current, whole_cpus(limit))


def fit_threads_to_cpu_quota(root: Path = CGROUP_ROOT) -> int | None:
    """Lowers torch's intra-op threads to the cgroup CPU quota; returns the new count, or None
    when nothing changed (no quota, enough CPUs, or OMP_NUM_THREADS set by the user)."""
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        return None
    limit = read_cpu_limit(root)
    current = torch.get_num_threads()
    wanted = threads_for_limit(current, limit)
    if wanted == current:
        return None
    torch.set_num_threads(wanted)
    log.info(
        "CPU quota of %.2f CPUs: torch intra-op threads %d -> %d (set OMP_NUM_THREADS to choose)",
        limit,
        current,
        wanted,
    )
    return wanted
