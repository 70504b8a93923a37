"""The Dockerfile's build context holds everything the build copies and the package needs.

A COPY whose source .dockerignore excludes fails every user's `docker build`; a package folder
(or package data) that setup.py maps but the Dockerfile does not copy builds an image that fails
at import. These checks read Dockerfile, .dockerignore, setup.py and pyproject.toml only (no
image build: image/build.sh does that, with buildah)."""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from pathlib import Path, PurePosixPath

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def dockerignore_rules(text: str) -> list[tuple[bool, re.Pattern[str]]]:
    """(excludes, pattern) per .dockerignore line, in order: Docker's matching, where `**` spans
    any number of folders, `*` and `?` stay within one, and the last matching line wins."""
    rules = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        excludes = not line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip().strip("/")))
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern.startswith("**", i):
                regex += ".*"
                i += 2
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            elif pattern[i] == "?":
                regex += "[^/]"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((excludes, re.compile(regex + r"\Z")))
    return rules


def in_context(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether a file (relative, POSIX) reaches the build context: a line matches a path when it
    matches the path or one of its parent folders."""
    parts = PurePosixPath(path).parts
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    included = True
    for excludes, regex in rules:
        if any(regex.match(candidate) for candidate in candidates):
            included = not excludes
    return included


def copy_sources(dockerfile: str) -> list[str]:
    """The sources of every COPY/ADD that reads the build context (not --from=another stage)."""
    text = dockerfile.replace("\\\n", " ")
    sources = []
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].upper() not in ("COPY", "ADD"):
            continue
        args = [word for word in words[1:] if not word.startswith("--")]
        if any(word.startswith("--from=") for word in words[1:]):
            continue
        sources += [src.rstrip("/") or "." for src in args[:-1]]
    return sources


def setup_literal(name: str) -> object:
    """A literal from setup.py: a module-level assignment, or a keyword of setup(...)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no literal {name}")


def tracked_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [path for path in out.split("\0") if path and (ROOT / path).is_file()]


@pytest.fixture(scope="module")
def rules() -> list[tuple[bool, re.Pattern[str]]]:
    return dockerignore_rules((ROOT / ".dockerignore").read_text())


@pytest.fixture(scope="module")
def sources() -> list[str]:
    return copy_sources((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def files() -> list[str]:
    return tracked_files()


def test_dockerignore_matching_follows_docker() -> None:
    rules = dockerignore_rules("**\n!engine/\n**/__pycache__\n!image/smoke.py\n")
    assert in_context("engine/cpu/build.py", rules)
    assert not in_context("engine/cpu/__pycache__/build.cpython-311.pyc", rules)
    assert not in_context("router/app.py", rules)
    assert in_context("image/smoke.py", rules)
    assert not in_context("image/build.sh", rules)


def test_copy_sources_are_found(sources: list[str]) -> None:
    assert {"setup.py", "pyproject.toml", "engine", "image/smoke.py"} <= set(sources)


def test_every_copied_file_is_in_the_build_context(
    sources: list[str], rules: list[tuple[bool, re.Pattern[str]]], files: list[str]
) -> None:
    for source in sources:
        under = [f for f in files if f == source or f.startswith(source + "/")]
        assert under, f"COPY {source}: no such file or folder in the repository"
        missing = [f for f in under if not in_context(f, rules)]
        assert not missing, f"COPY {source}: .dockerignore leaves out {missing[:5]}"


def test_every_package_folder_is_copied(sources: list[str]) -> None:
    folders = setup_literal("PACKAGE_FOLDERS")
    assert isinstance(folders, dict)
    for package, folder in folders.items():
        assert folder in sources, f"{package} ({folder}/) is not copied into the build stage"


def test_package_data_and_packaging_files_reach_the_build(
    sources: list[str], rules: list[tuple[bool, re.Pattern[str]]], files: list[str]
) -> None:
    folders = setup_literal("PACKAGE_FOLDERS")
    data = setup_literal("package_data")
    assert isinstance(folders, dict) and isinstance(data, dict)
    for package, globs in data.items():
        top = ".".join(package.split(".")[:2])
        folder = "/".join([folders[top], *package.split(".")[2:]])
        for glob in globs:
            matched = [f for f in files if fnmatch.fnmatch(f, f"{folder}/{glob}")]
            assert matched, f"package data {package}: {glob} matches no file"
            assert all(in_context(f, rules) for f in matched), f"{folder}/{glob} is ignored"
    readme = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["readme"]
    for needed in ("pyproject.toml", "setup.py", readme):
        assert needed in sources and in_context(needed, rules), f"{needed} not in the build"


def test_first_party_imports_name_mapped_packages(files: list[str]) -> None:
    """Code imports kvpilot.X only for an X that setup.py maps (and so the image copies)."""
    folders = setup_literal("PACKAGE_FOLDERS")
    assert isinstance(folders, dict)
    unmapped = set()
    for folder in folders.values():
        for path in (f for f in files if f.startswith(folder + "/") and f.endswith(".py")):
            for node in ast.walk(ast.parse((ROOT / path).read_text(), path)):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = ".".join(name.split(".")[:2])
                    if name.startswith("kvpilot.") and top not in folders:
                        unmapped.add(f"{path}: {name}")
    assert not unmapped, sorted(unmapped)


def test_the_cpu_image_needs_no_triton() -> None:
    """Triton (~1 GB, GPU only) is the gpu extra, which the CPU variant does not install."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [
        re.split(r"[<>=!~ ;\[]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]
    ]
    assert "triton" not in names
    assert any(dep.startswith("triton") for dep in project["optional-dependencies"]["gpu"])


def stages(dockerfile: str) -> list[str]:
    """The Dockerfile's stages, each from its FROM line on (continuation lines joined)."""
    text = dockerfile.replace("\\\n", " ")
    return ["FROM" + part for part in re.split(r"(?m)^FROM", text)[1:]]


def test_the_cpu_kernels_are_prebuilt_into_the_image() -> None:
    """The build stage compiles the kernels for every instruction set the engine can load
    prebuilt; the runtime stage copies them and points the engine at them, so a replica on a
    known CPU compiles nothing before it serves."""
    from kvpilot.engine.cpu.build import ISA_NAMES, PREBUILT_ENV

    build, runtime = stages((ROOT / "Dockerfile").read_text())
    prepare = re.search(
        r"python -m kvpilot\.engine\.prepare\s+--kernels-dir\s+(\S+)((?:\s+--isa\s+[\w-]+)+)", build
    )
    assert prepare, "the build stage does not run kvpilot.engine.prepare --kernels-dir"
    kernels_dir, isas = prepare.group(1), prepare.group(2).split()[1::2]
    assert sorted(isas) == sorted(ISA_NAMES)
    assert re.search(r"install [^&]*\bgcc\b", build), "the build stage has no compiler"
    assert f"COPY --from=build {kernels_dir} {kernels_dir}" in runtime
    assert re.search(rf"\b{PREBUILT_ENV}={re.escape(kernels_dir)}(\s|$)", runtime)


def test_the_cpu_runtime_has_no_compiler_but_the_kernels_openmp() -> None:
    """Only the cuda variant installs gcc (Triton compiles its launchers at run time)."""
    runtime = stages((ROOT / "Dockerfile").read_text())[-1]
    packages = dict(re.findall(r'(\w+)\) packages="([^"]*)"', runtime))
    assert set(packages) == {"cpu", "cuda"}, packages
    cpu = packages["cpu"].split()
    assert not {"gcc", "cc", "clang", "libc6-dev", "build-essential"} & set(cpu), cpu
    assert "libgomp1" in cpu  # the prebuilt kernels' NEEDED libgomp.so.1
    assert "gcc" in packages["cuda"].split()
    installs = re.findall(r"apt-get install[^&]*", runtime)
    assert installs and all("$packages" in line for line in installs), installs
