"""Removes from the image's site-packages what kvpilot never runs, in the build stage:

- what torch ships for building and testing torch itself: C++ test binaries and libraries,
  protoc, the C++ headers and CMake files (kvpilot builds no torch extension and uses no
  torch.compile);
- the symbol tables of torch's libraries (strip --strip-unneeded: the dynamic symbols that
  loading needs stay; ~90 MB of libtorch_cpu.so is its static symbol table);
- the kubernetes client's asyncio copy (kubernetes.aio: the operator and the router use the
  synchronous client, through kopf's own aiohttp for watches);
- the `tests` packages of the dependencies (sympy's, numpy's, networkx's, ...);
- the bytecode of transformers' model implementations (models/*/__pycache__/modeling_*.pyc,
  ~40 MB): kvpilot takes only tokenizers and configs from transformers and runs its own models;
  the sources stay (transformers' lazy imports list them);
- the symbol tables of every other shared library in site-packages (numpy's OpenBLAS, tokenizers,
  hf_xet, uvloop, ..., ~30 MB), as for torch's.

The image's smoke test (image/smoke.py) then imports every command and runs the model."""

from __future__ import annotations

import shutil
import subprocess
import sysconfig
from pathlib import Path

# File name prefixes of a transformers model's torch implementation.
TRANSFORMERS_MODEL_CODE = ("modeling_", "modular_")


def prune(site: Path) -> int:
    """Removes and strips; returns the bytes saved."""
    before = folder_size(site)
    torch = site / "torch"
    for path in (
        torch / "test",
        torch / "include",
        torch / "share" / "cmake",
        site / "kubernetes" / "aio",
    ):
        shutil.rmtree(path, ignore_errors=True)
    for path in (torch / "bin").glob("*"):
        if path.is_file() and path.name != "torch_shm_manager":
            path.unlink()
    for path in (torch / "lib").glob("*test*.so"):
        path.unlink()
    for path in (site / "transformers" / "models").glob("*/__pycache__/*.pyc"):
        if path.name.startswith(TRANSFORMERS_MODEL_CODE):
            path.unlink()
    for tests in sorted(site.glob("*/**/tests")):
        if tests.is_dir() and torch not in tests.parents:
            shutil.rmtree(tests, ignore_errors=True)
    libraries = sorted(
        str(path)
        for path in site.rglob("*.so*")
        if path.is_file() and not repaired_by_auditwheel(path, site)
    )
    subprocess.run(["strip", "--strip-unneeded", *libraries], check=True)
    return before - folder_size(site)


def repaired_by_auditwheel(library: Path, site: Path) -> bool:
    """A library auditwheel vendored (in a `<dist>.libs` folder) or pointed at one (its RUNPATH,
    set by patchelf): strip rewrites such files into ones the loader rejects ("ELF load command
    address/offset not page-aligned")."""
    if library.relative_to(site).parts[0].endswith(".libs"):
        return True
    dynamic = subprocess.run(
        ["readelf", "-d", str(library)], capture_output=True, text=True, check=False
    ).stdout
    return any(".libs" in line for line in dynamic.splitlines() if "PATH" in line)


def folder_size(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def main() -> None:
    site = Path(sysconfig.get_paths()["purelib"])
    print(f"pruned {prune(site) / 1e6:.0f} MB from {site}")


if __name__ == "__main__":
    main()
