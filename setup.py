"""Maps the contract/, engine/, operator/, router/ and cli/ folders to the import packages
kvpilot.contract (what the others agree on), kvpilot.engine, kvpilot.operator, kvpilot.router and
kvpilot.cli (the `kvpilot` command, which dispatches to the others)."""

from __future__ import annotations

from setuptools import find_namespace_packages, setup

PACKAGE_FOLDERS = {
    "kvpilot.contract": "contract",
    "kvpilot.engine": "engine",
    "kvpilot.operator": "operator",
    "kvpilot.router": "router",
    "kvpilot.cli": "cli",
}


def mapped_packages(prefix: str, folder: str) -> list[str]:
    found = find_namespace_packages(folder, exclude=["*__pycache__*"])
    return [prefix, *(f"{prefix}.{name}" for name in found)]


setup(
    packages=[
        pkg for prefix, folder in PACKAGE_FOLDERS.items() for pkg in mapped_packages(prefix, folder)
    ],
    package_dir=PACKAGE_FOLDERS,
    # The CPU kernels' C source is compiled on the serving machine, so it ships with the package.
    package_data={"kvpilot.engine.cpu": ["csrc/*.c"]},
)
