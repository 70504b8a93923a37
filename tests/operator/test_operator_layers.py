"""The operator's modules import one way: no import cycle among them, and autoscaling/ (the
scaling logic) never reaches up to what drives it (reconcile, handlers, builders, the Autoscaler
loop), directly or through a module that imports autoscaling back.

Read with ast from the source, every import statement counted (also those inside functions and
under TYPE_CHECKING: each is an arrow a reader has to follow). Importing `a.b.c` imports the
package `a.b` first, so a module also depends on the packages above what it names (other than
its own, whose import is under way when it runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

OPERATOR_DIR = Path(__file__).resolve().parents[2] / "operator"
PACKAGE = "kvpilot.operator"
AUTOSCALING = f"{PACKAGE}.autoscaling"
# What drives the autoscaling logic: autoscaling/ may import none of them.
ABOVE_AUTOSCALING = {
    f"{PACKAGE}.reconcile",
    f"{PACKAGE}.handlers",
    f"{PACKAGE}.builders",
    f"{PACKAGE}.autoscaler",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(OPERATOR_DIR).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((PACKAGE, *parts))


def operator_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(OPERATOR_DIR.rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every module an import statement of this file names (relative imports resolved)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            found.add(source)
            # `from package import module` imports the module too.
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def import_graph() -> dict[str, set[str]]:
    """Operator module -> the operator modules (and the packages above them) it imports."""
    modules = operator_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for target in imported_names(path, name):
            parts = target.split(".")
            for end in range(3, len(parts) + 1):  # kvpilot.operator.X and every level below
                prefix = ".".join(parts[:end])
                # A module's own packages are already being imported when it runs.
                if prefix in modules and not f"{name}.".startswith(f"{prefix}."):
                    edges.add(prefix)
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def is_autoscaling(name: str) -> bool:
    return name == AUTOSCALING or name.startswith(f"{AUTOSCALING}.")


def test_the_graph_sees_the_operators_imports() -> None:
    """The checks below are only worth something if the graph holds the known arrows."""
    graph = import_graph()
    assert f"{PACKAGE}.reconcile" in graph[f"{PACKAGE}.handlers"]
    assert f"{AUTOSCALING}.tick" in graph[f"{PACKAGE}.autoscaler"]
    assert AUTOSCALING in graph[f"{PACKAGE}.autoscaler"]  # the package above tick
    assert f"{AUTOSCALING}.decide" in graph[AUTOSCALING]


def test_no_import_cycle_among_operator_modules() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, " -> ".join(cycle or [])


def arrows_up(graph: dict[str, set[str]]) -> list[str]:
    """Each import from autoscaling/ of a module that drives it or that imports it back."""
    found = []
    inside = set(filter(is_autoscaling, graph))
    for name in sorted(inside):
        for target in sorted(graph[name] - inside):
            if target in ABOVE_AUTOSCALING:
                found.append(f"{name} imports {target}")
            back = sorted(reachable(graph, target) & inside)
            if back:
                found.append(f"{name} imports {target}, which imports {back[0]} back")
    return found


def test_autoscaling_never_imports_what_drives_it() -> None:
    assert arrows_up(import_graph()) == []


def test_the_checks_catch_a_cycle_and_an_arrow_up() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    up = {**import_graph(), f"{AUTOSCALING}.decide": {f"{PACKAGE}.reconcile"}}
    assert f"{AUTOSCALING}.tick" in reachable(up, f"{PACKAGE}.reconcile")
    assert find_cycle(up) is not None
    assert f"{AUTOSCALING}.decide imports {PACKAGE}.reconcile" in arrows_up(up)
    back = {**import_graph(), f"{AUTOSCALING}.zero": {f"{PACKAGE}.spec"}}  # spec -> autoscaling
    assert any(arrow.endswith("back") for arrow in arrows_up(back))
