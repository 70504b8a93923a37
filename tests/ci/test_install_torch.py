"""`.ci/install-torch` takes torch from a local wheel where pip's configuration offers the pinned
version, and from the PyTorch CPU index otherwise (never PyPI's CUDA build)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / ".ci" / "install-torch"


def make_wheel(folder: Path, version: str) -> Path:
    """A minimal valid wheel named torch: enough for pip to resolve it from find-links."""
    info = f"torch-{version}.dist-info"
    path = folder / f"torch-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        metadata = f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n"
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        wheel.writestr(f"{info}/RECORD", "")
    return path


def torch_source(find_links: Path) -> str:
    """Where the script would take torch from, with find_links as pip's only local source."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PIP_CONFIG_FILE": os.devnull,  # this machine's pip.conf names its own wheel folder
        "PIP_FIND_LINKS": str(find_links),
    }
    env.pop("PIP_EXTRA_INDEX_URL", None)
    done = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_no_local_wheel_means_the_cpu_index(tmp_path: Path) -> None:
    assert torch_source(tmp_path) == "cpu-index"


def test_a_local_wheel_of_the_pinned_version_is_taken(tmp_path: Path) -> None:
    make_wheel(tmp_path, "2.13.0+cpu")
    assert torch_source(tmp_path) == "local"


def test_a_local_wheel_of_another_version_is_not(tmp_path: Path) -> None:
    make_wheel(tmp_path, "2.12.0+cpu")
    assert torch_source(tmp_path) == "cpu-index"
