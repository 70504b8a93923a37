"""Will the model fit in this container's memory? Checked at start, before anything big is
allocated: the weights, the KV cache and the working memory of a CPU engine all live in the
container's RAM, and an engine that does not fit would otherwise be OOM-killed under its first
real load (a crash loop instead of a message).

The need is the contract's arithmetic (contract/sizing.py), which the operator computes too. The
limit comes from the cgroup the process runs in (v2 `memory.max`, or v1
`memory.limit_in_bytes`), the smallest one on the way up to the root.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from kvpilot.contract.sizing import MemoryNeed

CGROUP_ROOT = Path("/sys/fs/cgroup")
# cgroup v1 reports "no limit" as a huge page-aligned number, not "max".
_V1_UNLIMITED = 1 << 62
# Overrides the cgroup's limit where it is not visible (or to check a size before deploying).
LIMIT_ENV = "KVPILOT_MEMORY_LIMIT_BYTES"


def memory_limit(env: Mapping[str, str] = os.environ) -> int | None:
    """$KVPILOT_MEMORY_LIMIT_BYTES if set, else the container's cgroup limit."""
    given = env.get(LIMIT_ENV)
    if given:
        return int(given)
    return container_memory_limit()


def container_memory_limit(
    root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int | None:
    """The memory limit of the cgroup this process is in, in bytes; None when unlimited or
    unknown (no cgroup filesystem, as on macOS)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            limits += _limits_up(root, path, "memory.max")
        elif "memory" in controllers.split(","):
            limits += _limits_up(root / "memory", path, "memory.limit_in_bytes")
    real = [limit for limit in limits if limit < _V1_UNLIMITED]
    return min(real) if real else None


def _limits_up(base: Path, path: str, name: str) -> list[int]:
    """The limit file's values from the process's cgroup up to the root (inside a container the
    cgroup namespace makes its own cgroup the root, which is where its limit shows)."""
    found = []
    here = Path(path.strip() or "/")
    for directory in (here, *here.parents):
        try:
            value = (base / directory.relative_to("/") / name).read_text().strip()
        except (OSError, ValueError):
            continue
        if value != "max":
            found.append(int(value))
    return found


class MemoryFitError(ValueError):
    """The engine would not fit in its container's memory limit."""


def check_memory_fit(need: MemoryNeed, limit: int | None) -> None:
    """Raise MemoryFitError, with every figure and what to change, unless need fits in limit."""
    if limit is None or need.total <= limit:
        return
    gib = 2**30
    draft = (
        f" + draft model (weights and its KV cache) {need.draft / gib:.2f} GiB"
        if need.draft
        else ""
    )
    adapters = f" + LoRA adapters {need.adapters / gib:.2f} GiB" if need.adapters else ""
    raise MemoryFitError(
        f"the engine needs about {need.total / gib:.2f} GiB but the container's memory limit is "
        f"{limit / gib:.2f} GiB: weights {need.weights / gib:.2f} GiB + KV cache "
        f"{need.kv_cache / gib:.2f} GiB + working memory {need.working / gib:.2f} GiB"
        f"{draft}{adapters}. Lower the KV-cache budget (--kv-cache-memory-bytes / "
        "--kv-cache-gib; spec.engine.kvCacheBytes), max_num_batched_tokens or max_num_seqs, use "
        "a smaller dtype (or a smaller draft model, or a lower disable_by_batch_size in "
        "--speculative-config), or raise the memory limit."
    )
