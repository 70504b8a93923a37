"""pip-installs requirements with their whole dependency closure except the named distributions.

    python pip_install_without.py --without triton .

For a distribution that a dependency requires but this image never runs: xgrammar requires Triton
on every Linux x86-64 machine, yet imports it only for its CUDA bitmask kernel, so the CPU image
leaves Triton (~1 GB) out. pip resolves the closure (--dry-run --report), and everything resolved
but the left-out names is then installed without further resolution (--no-deps)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", action="append", default=[], metavar="NAME")
    parser.add_argument("requirements", nargs="+")
    args = parser.parse_args()
    pip = [sys.executable, "-m", "pip"]
    left_out = {canonical(name) for name in args.without}
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run(
            [*pip, "install", "--dry-run", "--quiet", "--report", str(report), *args.requirements],
            check=True,
        )
        resolved = json.loads(report.read_text())["install"]
    pins = []
    for item in resolved:
        name, version = item["metadata"]["name"], item["metadata"]["version"]
        if canonical(name) in left_out:
            print(f"leaving out {name} {version}")
            continue
        # Local requirements (the project folder) by their path, the rest pinned by version.
        pins.append(item["download_info"]["url"] if item.get("is_direct") else f"{name}=={version}")
    subprocess.run([*pip, "install", "--no-deps", *pins], check=True)


if __name__ == "__main__":
    main()
