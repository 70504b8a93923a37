"""The engine runs on a read-only root filesystem, as the operator's pods do
(readOnlyRootFilesystem): every write goes to $KVPILOT_CACHE_DIR (the model-cache volume) or
/tmp-like scratch ($HOME, $TMPDIR). A private mount namespace makes / read-only for one real
`kvpilot serve`, leaving only those two directories writable."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from kvpilot.engine.model.gguf_convert import cache_root

from .serve_process import launch_serve

READ_ONLY_ROOT = (
    'mount --bind "$SCRATCH" "$SCRATCH" && mount --bind "$CACHE" "$CACHE" && '
    'mount -o remount,bind,ro / && exec "$@"'
)


def read_only_wrapper() -> tuple[str, ...]:
    return ("unshare", "--mount", "--propagation", "private", "sh", "-c", READ_ONLY_ROOT, "sh")


def can_make_root_read_only(tmp_path: Path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        [*read_only_wrapper(), "true"],
        env={"SCRATCH": str(tmp_path), "CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
    )
    return probe.returncode == 0


def test_serve_works_with_a_read_only_root(tmp_path: Path) -> None:
    if not can_make_root_read_only(tmp_path):
        pytest.skip("needs unshare and mount (a private mount namespace) to make / read-only")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    cache = cache_root()  # the converted model is there already (or is converted into it)
    cache.mkdir(parents=True, exist_ok=True)
    env = {
        "SCRATCH": str(scratch),
        "CACHE": str(cache),
        "HOME": str(scratch),
        "TMPDIR": str(scratch),
        "KVPILOT_CACHE_DIR": str(cache),
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # The wrapper really makes the root read-only (else this test proves nothing).
    denied = subprocess.run(
        [*read_only_wrapper(), "touch", str(Path(__file__).parent / "written-by-test")],
        env={**env, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert denied.returncode != 0 and "Read-only file system" in denied.stderr
    with launch_serve(
        "--kv-cache-gib", "0.02", "--max-model-len", "256", wrapper=read_only_wrapper(), env=env
    ) as served:
        response = httpx.post(
            f"{served.url}/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] == 4
        log = "".join(served.log)
        assert "Read-only file system" not in log, log[-3000:]
