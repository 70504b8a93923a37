"""Every import arrow points down: between kvpilot's packages (cli -> router -> operator ->
engine, all of them -> contract), and inside each of them (no two folders or modules that import
each other, directly or around a circle, lazy imports included).

A circle is an arrow back up: with one, neither side can be read, tested or replaced alone. The
one exception is the attention backend registry, which picks an implementation by name and whose
implementations import the interface back (tests/engine/test_import_structure.py holds it to that
one function).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = {
    "kvpilot.contract": "contract",
    "kvpilot.engine": "engine",
    "kvpilot.operator": "operator",
    "kvpilot.router": "router",
    "kvpilot.cli": "cli",
}
# What each package may import of the others: a layer sees only the layers below it.
MAY_IMPORT = {
    "kvpilot.contract": set(),
    "kvpilot.engine": {"kvpilot.contract"},
    "kvpilot.operator": {"kvpilot.contract", "kvpilot.engine"},
    "kvpilot.router": {"kvpilot.contract", "kvpilot.engine", "kvpilot.operator"},
    "kvpilot.cli": {"kvpilot.contract", "kvpilot.engine", "kvpilot.operator", "kvpilot.router"},
}
# (module, function) pairs whose lazy imports pick an implementation by name.
REGISTRIES = {("kvpilot.engine.attention", "get_attention_backend")}
# Folders that sit below named parts of their package: they may import none of those.
BELOW = {
    "kvpilot.engine.kv_cache": (
        "kvpilot.engine.scheduler", "kvpilot.engine.model_runner", "kvpilot.engine.core",
        "kvpilot.engine.executor", "kvpilot.engine.server", "kvpilot.engine.llm_engine",
    ),
    "kvpilot.engine.parallel": (
        "kvpilot.engine.model_runner", "kvpilot.engine.core", "kvpilot.engine.executor",
        "kvpilot.engine.model", "kvpilot.engine.server",
    ),
    # The autoscaler loop (operator/autoscaler.py) drives it and writes through reconcile.
    "kvpilot.operator.autoscaling": (
        "kvpilot.operator.reconcile", "kvpilot.operator.handlers", "kvpilot.operator.builders",
        "kvpilot.operator.autoscaler",
    ),
}  # fmt: skip


def modules(package: str) -> dict[str, Path]:
    root = REPO / FOLDERS[package]
    found = {}
    for path in root.rglob("*.py"):
        parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
        found[".".join([package, *parts])] = path
    return found


def imported_names(tree: ast.Module) -> list[tuple[str, str | None]]:
    """(imported dotted name, enclosing top-level function or None) for every absolute import,
    lazy ones included; `from a import b` yields both a and a.b, since b may be a module.
    TYPE_CHECKING blocks never run, so they are left out."""
    found: list[tuple[str, str | None]] = []

    def visit(node: ast.AST, function: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                visit(child, function or child.name)
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import):
                found.extend((alias.name, function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                found.append((child.module, function))
                found.extend((f"{child.module}.{a.name}", function) for a in child.names)
            visit(child, function)

    visit(tree, None)
    return found


def imports(path: Path, module: str) -> set[str]:
    """Every kvpilot name the file imports, lazy imports included, registry functions' left out."""
    return {
        name
        for name, function in imported_names(ast.parse(path.read_text()))
        if name.startswith("kvpilot.") and (module, function) not in REGISTRIES
    }


def unit_of(module: str, package: str) -> str:
    """The folder or top-level module of `package` that `module` belongs to."""
    rest = module[len(package) + 1 :].split(".")
    return f"{package}.{rest[0]}" if rest[0] else package


def unit_graph(package: str) -> dict[str, set[str]]:
    """Unit -> the units of the same package it imports (a unit is a sub-folder or a top-level
    module; the package's own __init__ is left out)."""
    known = modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        if name == package:
            continue
        source = unit_of(name, package)
        graph.setdefault(source, set())
        for target in imports(path, name):
            pieces = target.split(".")
            for i in range(len(pieces), 2, -1):  # the longest prefix that is a module
                if ".".join(pieces[:i]) in known:
                    dep = unit_of(".".join(pieces[:i]), package)
                    if dep != source and dep != package:
                        graph[source].add(dep)
                    break
    return graph


def module_graph(package: str) -> dict[str, set[str]]:
    known = modules(package)
    graph = {name: set() for name in known}
    for name, path in known.items():
        for target in imports(path, name):
            pieces = target.split(".")
            for i in range(len(pieces), 2, -1):
                dep = ".".join(pieces[:i])
                if dep in known and dep != name and not name.startswith(dep + "."):
                    graph[name].add(dep)
                    break
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_a_package_imports_only_the_layers_below_it(package: str) -> None:
    wrong = sorted(
        f"{path.relative_to(REPO)}: {target}"
        for name, path in modules(package).items()
        for target in imports(path, name)
        if not target.startswith(package + ".")
        and target != package
        and not any(target == o or target.startswith(o + ".") for o in MAY_IMPORT[package])
    )
    assert not wrong, wrong


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_no_two_folders_of_a_package_import_each_other(package: str) -> None:
    cycle = find_cycle(unit_graph(package))
    assert cycle is None, "arrow back up: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("package", sorted(FOLDERS))
def test_no_import_circle_between_modules(package: str) -> None:
    cycle = find_cycle(module_graph(package))
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize("folder", sorted(BELOW))
def test_a_lower_folder_imports_nothing_above_it(folder: str) -> None:
    package = ".".join(folder.split(".")[:2])
    above = BELOW[folder]
    wrong = sorted(
        f"{name}: {target}"
        for name, path in modules(package).items()
        if name == folder or name.startswith(folder + ".")
        for target in imports(path, name)
        if any(target == a or target.startswith(a + ".") for a in above)
    )
    assert not wrong, wrong


def test_the_checks_see_a_circle_and_an_arrow_up() -> None:
    """The graph is built from the real tree: these edges exist, so a reversed one would close a
    circle the checks above report."""
    engine = unit_graph("kvpilot.engine")
    assert "kvpilot.engine.kv_cache" in engine["kvpilot.engine.scheduler"]
    assert "kvpilot.engine.parallel" in engine["kvpilot.engine.model"]
    assert "kvpilot.engine.model_runner" in engine["kvpilot.engine.executor"]
    operator = unit_graph("kvpilot.operator")
    assert "kvpilot.operator.autoscaling" in operator["kvpilot.operator.autoscaler"]
    assert "kvpilot.operator.reconcile" in operator["kvpilot.operator.handlers"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
