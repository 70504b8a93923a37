"""The docs a new user reads first hold: every repository path they name exists, the README's
Python uses what it builds, and the resource requests the operator's README states are the chart's
and the example's."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = (
    "README.md",
    "ARCHITECTURE.md",
    "operator/README.md",
    "operator/autoscaling/README.md",
    "engine/server/README.md",
    "engine/cpu/README.md",
    "router/README.md",
)
EXTERNAL_LINK = re.compile(r"\[[^\]]*\]\((?:https?|mailto):[^)]*\)|https?://\S+")
LINK_TARGET = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
# A path of this repository: one of its top-level entries, then folders, then maybe a file.
PATH = re.compile(r"(?<![\w/.:~$-])((?:\.\.?/)?(?:[\w.-]+/)+[\w.*-]*)")


def named_paths(doc: Path) -> set[tuple[str, Path]]:
    """(as written, where it points) for each link target and each path-looking word whose first
    part is a top-level entry of the repository (relative to the repository; a link or a ../ path
    relative to the doc)."""
    tops = {entry.name for entry in ROOT.iterdir()}
    text = EXTERNAL_LINK.sub("", doc.read_text())
    found = {(t, doc.parent / t) for t in LINK_TARGET.findall(text)}
    for word in PATH.findall(text):
        word = word.rstrip(".")
        if word.startswith("../"):
            found.add((word, doc.parent / word))
        elif word.split("/")[0] in tops:
            found.add((word, ROOT / word))
    return found


def exists(path: Path) -> bool:
    if "*" in path.name:
        return any(path.parent.glob(path.name))
    return path.exists()


@pytest.mark.parametrize("doc", DOCS)
def test_every_path_a_doc_names_exists(doc: str) -> None:
    named = named_paths(ROOT / doc)
    assert len(named) >= 1
    missing = sorted(written for written, path in named if not exists(path.resolve()))
    assert not missing, f"{doc} names paths that do not exist: {missing}"


def test_the_path_finder_sees_paths_and_skips_urls(tmp_path: Path) -> None:
    doc = ROOT / "operator" / "README.md"
    words = {written for written, _ in named_paths(doc)}
    assert {
        "charts/kvpilot/values.yaml",
        "../charts/kvpilot/files/dashboards/kvpilot.json",
    } <= words
    assert not any("prometheus_grafana" in word for word in words)  # only in vLLM's repository


def python_blocks(markdown: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", markdown, re.DOTALL)


def test_the_readmes_python_uses_every_name_it_assigns() -> None:
    blocks = python_blocks((ROOT / "README.md").read_text())
    assert len(blocks) >= 2
    for block in blocks:
        tree = ast.parse(block)
        assigned = {
            target.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Assign)
            for target in node.targets
            if isinstance(target, ast.Name)
        }
        used = {
            node.id
            for node in ast.walk(tree)
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
        }
        assert assigned - used == set(), block


def requests(resources: dict) -> tuple[str, str]:
    return str(resources["requests"]["cpu"]), str(resources["requests"]["memory"])


def test_the_operator_readme_states_the_charts_and_the_examples_requests() -> None:
    values = yaml.safe_load((ROOT / "charts" / "kvpilot" / "values.yaml").read_text())
    example = yaml.safe_load((ROOT / "examples" / "smollm2-cpu.yaml").read_text())
    readme = " ".join((ROOT / "operator" / "README.md").read_text().split())
    engine_cpu, engine_memory = requests(example["spec"]["resources"])
    operator_cpu, operator_memory = requests(values["resources"])
    router_cpu, router_memory = requests(values["router"]["resources"])
    stated = (
        f"each SmolLM2 replica of examples/smollm2-cpu.yaml `{engine_cpu}` CPU and "
        f"`{engine_memory}`; the chart's operator `{operator_cpu}` and `{operator_memory}`, each "
        f"of its `{values['router']['replicas']}` routers `{router_cpu}` and `{router_memory}`"
    )
    assert stated in readme
