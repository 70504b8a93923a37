"""Keep the heap memory a step frees for the next step, instead of handing it back to the kernel.

A CPU step allocates and frees the same large activations every time (a 2048-token bf16 prefill
step of SmolLM2 allocates ~400 MB in 6-25 MB tensors). glibc's malloc returns memory to the
kernel when the free space at the top of its heap passes a threshold, and serves large blocks
with fresh mmaps; both thresholds move as the program runs. Once they let go, every step
page-faults its activations back in, page by page, and zeroes each page: measured on SmolLM2
prefill, up to ~400,000 minor faults per 8k prompt tokens and 5-12 % of the time, starting at a
point that depends on the history of allocations (bench/RESULTS.md, "The batch-64 gap found").
Fixing both thresholds keeps the peak step's working set mapped: the process holds what its
largest step needed, as any caching allocator does, plus what the heap's fragmentation adds to it
(measured: +75 MiB of peak RSS in bfloat16, +240 MiB in float32, bounded: it stops growing after
the first steps; the example pod's measured peak stayed under its limit).

Only glibc has these knobs (musl and others: nothing is done). A user who sets glibc's own
environment (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_, MALLOC_TOP_PAD_, or malloc
tunables in GLIBC_TUNABLES) keeps their choice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
from collections.abc import Mapping

log = logging.getLogger(__name__)

# mallopt parameters (<malloc.h>).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit systems. Blocks
# larger than that are still mmapped per allocation.
MAX_MMAP_THRESHOLD = 32 * 2**20
# Free space at the top of the heap kept rather than given back: mallopt takes an int, and its
# largest (2 GiB) is more than any step frees.
TRIM_THRESHOLD = 2**31 - 1

USER_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def user_chose_malloc(environ: Mapping[str, str]) -> bool:
    """Whether the environment already sets glibc's heap thresholds."""
    if any(environ.get(name) for name in USER_MALLOC_ENV):
        return True
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "")


def load_glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        version = libc.gnu_get_libc_version  # glibc only
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    version.restype = ctypes.c_char_p
    version.argtypes = []
    mallopt.restype = ctypes.c_int
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return libc


def retain_freed_memory(environ: Mapping[str, str] = os.environ) -> bool:
    """Fixes glibc's trim and mmap thresholds for this process; True when it did."""
    if user_chose_malloc(environ):
        log.info("heap thresholds left as the environment sets them")
        return False
    libc = load_glibc()
    if libc is None:
        return False
    ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    ok = libc.mallopt(M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD) == 1 and ok
    if not ok:
        log.warning("glibc %s refused the heap thresholds", libc.gnu_get_libc_version().decode())
    return ok
