"""Derived files (converted weights) published once into a cache that several processes, pods
included, may share: built in a private temporary directory beside the destination, renamed into
place (atomic within one filesystem), under an exclusive lock on a file next to it, so that two
processes wanting the same entry build it once and neither ever sees half of it."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger("kvpilot")


@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """flock on `path` (created if missing), released on exit and by the kernel if we die."""
    with open(path, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def publish_once(
    dest: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]
) -> bool:
    """Make `dest` exist, complete, calling build(empty directory) at most once across every
    process that shares its filesystem. Returns whether this call built it."""
    if is_complete(dest):
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(dest.parent / f"{dest.name}.lock"):
        if is_complete(dest):  # built by another process while we waited for the lock
            return False
        if dest.exists():  # left by a crash of an older layout: never trusted
            shutil.rmtree(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".partial-{dest.name}-", dir=dest.parent))
        try:
            build(tmp)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    log.info("published %s", dest)
    return True
