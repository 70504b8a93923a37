"""A child process that must not outlive its parent (the engine core, tensor-parallel workers,
the big-body preprocessing worker): the kernel kills it when the parent goes (Linux), and it exits
at once if the parent is already gone."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel kill this process when its parent goes (Linux), and exit now if it has
    already gone."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong]
            libc.prctl.restype = ctypes.c_int
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        os._exit(1)
