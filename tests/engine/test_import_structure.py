"""The engine's import structure: no import circles, the model knows only interfaces, and LayerOps
is defined once.

The attention backends and the model meet in four packages (attention/__init__ ->
cpu/attention_backend -> cpu/layer_ops -> model/llama -> attention): the model may import only the
interfaces, and only get_attention_backend may reach down to an implementation by name, lazily,
or which module a process imported first would decide whether the import fails. (Every kvpilot
package's layering is tests/test_layers.py.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from ..test_layers import imported_names

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "engine"
PREFIX = "kvpilot.engine"

# Lazy imports that pick an implementation by name: the one place allowed to point from an
# interface package down to its implementations (which import the interface back).
REGISTRIES = {(f"{PREFIX}.attention", "get_attention_backend")}
# Modules the model is built from; they may import interfaces, never an implementation.
MODEL = (f"{PREFIX}.model.llama", f"{PREFIX}.model.layer_ops", f"{PREFIX}.attention.base")
IMPLEMENTATIONS = (f"{PREFIX}.cpu", f"{PREFIX}.kernels")


def engine_modules() -> dict[str, Path]:
    modules = {}
    for path in ENGINE.rglob("*.py"):
        parts = [p for p in path.relative_to(ENGINE).with_suffix("").parts if p != "__init__"]
        modules[".".join([PREFIX, *parts])] = path
    return modules


def import_graph() -> dict[str, set[str]]:
    """Engine module -> the engine modules importing it runs. Importing a.b.c also runs a.b's
    __init__, except where the importer lives in a.b itself (its package is already running)."""
    modules = engine_modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        parts = name.split(".")
        running = {".".join(parts[:i]) for i in range(1, len(parts) + (path.stem == "__init__"))}
        for target, function in imported_names(ast.parse(path.read_text())):
            if (name, function) in REGISTRIES:
                continue
            pieces = target.split(".")
            for i in range(3, len(pieces) + 1):
                dep = ".".join(pieces[:i])
                if dep in modules and dep not in running and dep != name:
                    graph[name].add(dep)
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    return seen


def test_the_graph_sees_the_backends_and_the_models_imports() -> None:
    graph = import_graph()
    assert f"{PREFIX}.cpu.layer_ops" in graph[f"{PREFIX}.cpu.attention_backend"]
    assert f"{PREFIX}.attention.base" in graph[f"{PREFIX}.model.llama"]


@pytest.mark.parametrize("module", MODEL)
def test_the_model_imports_only_interfaces(module: str) -> None:
    reached = reachable(import_graph(), module)
    wrong = sorted(m for m in reached if m.startswith(IMPLEMENTATIONS))
    assert not wrong, f"{module} reaches implementations: {wrong}"


def test_implementations_do_not_import_the_model() -> None:
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith(IMPLEMENTATIONS):
            assert f"{PREFIX}.model.llama" not in deps, f"{name} imports the model"


def run_python(*codes: str) -> None:
    """Each snippet in a fresh interpreter of its own, a few at a time: one at a time would leave
    a core idle while each loads torch."""

    def run(code: str) -> None:
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
        )
        assert result.returncode == 0, (code, result.stderr[-4000:])

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(run, codes))


# Each first in a fresh interpreter, then the rest in every rotation: whichever module a process
# happens to import first must not matter.
CIRCLE = (
    f"{PREFIX}.attention",
    f"{PREFIX}.cpu.attention_backend",
    f"{PREFIX}.cpu.layer_ops",
    f"{PREFIX}.model.llama",
    f"{PREFIX}.model.layer_ops",
    f"{PREFIX}.kernels",
    f"{PREFIX}.kernels.attention_backend",
    f"{PREFIX}.model.loader",
)


def test_any_import_order_works() -> None:
    rotations = [CIRCLE[i:] + CIRCLE[:i] for i in range(len(CIRCLE))]
    rotations += [tuple(reversed(order)) for order in rotations]
    # One interpreter (torch, the slow part, stays loaded); every order starts with no kvpilot
    # module loaded.
    script = (
        "import importlib, sys\n"
        f"for order in {rotations!r}:\n"
        "    for name in [m for m in sys.modules if m.startswith('kvpilot')]:\n"
        "        del sys.modules[name]\n"
        "    for name in order:\n"
        "        importlib.import_module(name)\n"
    )
    run_python(script, *(f"import {module}" for module in CIRCLE))


def test_importing_the_model_loads_no_implementation() -> None:
    run_python(
        "import sys\n"
        "import kvpilot.engine.model.llama, kvpilot.engine.model.loader\n"
        f"loaded = sorted(m for m in sys.modules if m.startswith({IMPLEMENTATIONS!r}))\n"
        "assert not loaded, loaded\n"
    )


def test_layer_ops_is_defined_once() -> None:
    sources = [
        path
        for folder in ("engine", "operator", "cli", "bench", "tests")
        for path in (REPO / folder).rglob("*.py")
    ]
    defined = [
        str(path.relative_to(REPO))
        for path in sources
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name == "LayerOps"
    ]
    assert defined == ["engine/model/layer_ops.py"], defined


def test_the_engine_never_imports_the_operator() -> None:
    """The engine knows nothing of the operator, nor of the `kvpilot` command that dispatches to
    both (kvpilot.cli)."""
    wrong = [
        f"{path.relative_to(REPO)}: {name}"
        for path in ENGINE.rglob("*.py")
        for name, _ in imported_names(ast.parse(path.read_text()))
        if name.startswith(("kvpilot.operator", "kvpilot.cli"))
    ]
    assert not wrong, wrong
    run_python(
        "import sys\n"
        "import kvpilot.engine, kvpilot.engine.server.cli, kvpilot.engine.generate_cli\n"
        "from kvpilot.engine import LLMEngine\n"
        "loaded = sorted(m for m in sys.modules if m.startswith(('kvpilot.operator', 'kopf')))\n"
        "assert not loaded, loaded\n"
    )
