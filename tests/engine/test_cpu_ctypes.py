"""The ctypes boundary of the C kernels: every entry point has argtypes and restype, they match the
C prototypes, and a call with too few arguments or a wrong type raises before any C runs."""

from __future__ import annotations

import ctypes
import re
import subprocess

import pytest
import torch

from kvpilot.engine.cpu import build

LIB = build.load_library()
needs_lib = pytest.mark.skipif(LIB is None, reason="no C compiler: the CPU kernels are not built")

C_TYPES: dict[str, type] = {"int64_t": ctypes.c_int64, "float": ctypes.c_float, "int": ctypes.c_int}


def exported_definitions(source: str) -> dict[str, tuple[list[str], str]]:
    """name -> (parameter declarations, result type) of every non-static function defined at the
    top level of a preprocessed kernel source (its own lines only, not the headers')."""
    own, keep = [], False
    for line in source.splitlines():
        if marker := re.match(r'# \d+ "([^"]*)"', line):
            keep = marker[1].endswith(tuple(source.name for source in build.SOURCES))
        elif keep:
            own.append(line)
    text, found, depth, start = "\n".join(own), {}, 0, 0
    for i, char in enumerate(text):
        if char == "{":
            if depth == 0:
                head = " ".join(text[start:i].split())
                match = re.fullmatch(
                    r"(?P<result>[\w ]+?) (?P<name>\w+)\((?P<params>[^()]*)\)", head
                )
                if match and "static" not in match["result"].split():
                    params = [p.strip() for p in match["params"].split(",")]
                    found[match["name"]] = ([] if params == ["void"] else params, match["result"])
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                start = i + 1
        elif char == ";" and depth == 0:
            start = i + 1
    return found


def ctype_of(declaration: str) -> type | None:
    """`const T *x` -> c_void_p (a data_ptr()), `int64_t n` -> c_int64, `void` result -> None."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.replace("const ", "").split()
    if words == ["void"]:
        return None
    return C_TYPES[words[0]]


@pytest.mark.skipif(build.c_compiler() is None, reason="no C compiler to preprocess the sources")
def test_the_table_matches_the_c_prototypes() -> None:
    definitions: dict[str, tuple[list[str], str]] = {}
    for path in build.SOURCES:
        source = subprocess.run(
            [build.c_compiler(), "-E", "-march=native", str(path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        found = exported_definitions(source)
        assert found, f"no entry point found in {path.name}"
        assert not set(found) & set(definitions), "an entry point defined twice"
        definitions.update(found)
    table = build.signatures()
    assert sorted(definitions) == sorted(table), "an entry point without a row, or the reverse"
    for name, (params, result) in definitions.items():
        argtypes, restype = table[name]
        assert [ctype_of(p) for p in params] == argtypes, f"{name}({', '.join(params)})"
        assert ctype_of(result) is restype, f"{result} {name}"


def test_the_parser_sees_what_it_must() -> None:
    source = (
        '# 1 "x/cpu_ops.c"\n'
        "static inline float helper(float x) { return x; }\n"
        "void f_f32(const float *a, int64_t n, float s) { if (n) { a++; } }\n"
        "int g(void) { return 1; }\n"
        '# 1 "/usr/include/math.h"\n'
        "double sqrt(double x) { return x; }\n"
    )
    assert exported_definitions(source) == {
        "f_f32": (["const float *a", "int64_t n", "float s"], "void"),
        "g": ([], "int"),
    }


@needs_lib
def test_every_entry_point_declares_argtypes_and_restype() -> None:
    for name, (argtypes, restype) in build.signatures().items():
        fn = getattr(LIB, name)
        assert fn.argtypes is not None and list(fn.argtypes) == argtypes, name
        assert fn.restype is restype, name


@needs_lib
@pytest.mark.parametrize("name", sorted(build.signatures()))
def test_a_wrong_call_raises_before_c_runs(name: str) -> None:
    argtypes, _ = build.signatures()[name]
    fn = getattr(LIB, name)
    if not argtypes:  # the thread count (>= 1) or the linear kernels' bit set (>= 0)
        assert fn() >= (0 if name == "kvpilot_linear_available" else 1)
        return
    with pytest.raises(TypeError, match=f"takes at least {len(argtypes)} argument"):
        fn(*[0] * (len(argtypes) - 1))  # null pointers and zeros: C would crash on a run
    for i, ctype in enumerate(argtypes):
        args: list[object] = [0] * len(argtypes)
        # A tensor instead of its data_ptr(), a float for an int64, a pointer for a float.
        args[i] = {ctypes.c_void_p: torch.zeros(1), ctypes.c_int64: 1.5}.get(ctype, "x")
        with pytest.raises(ctypes.ArgumentError, match=f"argument {i + 1}"):
            fn(*args)
