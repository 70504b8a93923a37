"""Where kernels run: the per-launch choice of compiler or interpreter, and what the interpreter
leaves behind in a process that also compiles (a GPU test session)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter

from kvpilot.engine.kernels import runtime
from kvpilot.engine.kernels.rms_norm import rms_norm
from kvpilot.engine.model import layers


def test_installed_triton_is_one_the_interpreter_workarounds_were_checked_on() -> None:
    """Fails as soon as CI's Triton moves outside the checked range, or its interpreter internals
    change shape: re-read runtime.py's uses of them against the new interpreter.py, then widen
    runtime.INTERPRETER_TRITON_RANGE."""
    problem = runtime.interpreter_problem_for(triton.__version__, interpreter)
    assert problem is None, f"runtime.py must be re-checked for this Triton: {problem}"


@pytest.mark.parametrize(
    ("version", "supported"),
    (("3.5.1", False), ("3.6.0", True), ("3.7.1+git1234", True), ("3.9.0", True), ("3.10.0", False),
     ("4.0.0", False), ("main", False)),
)  # fmt: skip
def test_version_range(version: str, supported: bool) -> None:
    problem = runtime.interpreter_problem_for(version, interpreter)
    assert (problem is None) is supported, problem
    if problem is not None:
        assert "outside 3.6-3.9" in problem


def test_changed_internals_are_named() -> None:
    def patch_lang(fn: object) -> None:
        pass

    class Interpreted:
        def __init__(self, fn: object) -> None:
            self.fn = fn

        def rewrite(self) -> None:
            pass

    scope = SimpleNamespace(restore=lambda: None)
    fine = SimpleNamespace(
        _patch_lang=patch_lang, _LangPatchScope=scope, InterpretedFunction=Interpreted
    )
    assert runtime.interpreter_problem_for("3.9.0", fine) is None
    for name, value, message in (
        ("_patch_lang", None, "_patch_lang(fn) is gone"),
        ("_patch_lang", lambda fn, scope: None, "changed its signature"),
        ("_LangPatchScope", object, "no restore()"),
        ("InterpretedFunction", object, "rewrite() is gone"),
    ):
        changed = SimpleNamespace(**{**vars(fine), name: value})
        problem = runtime.interpreter_problem_for("3.9.0", changed)
        assert problem is not None and message in problem


def test_unsupported_interpreter_falls_back_or_refuses(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runtime, "interpreter_problem", lambda: "Triton 9.0 is outside 3.6-3.9")
    cpu = torch.zeros(1)
    with caplog.at_level(logging.WARNING, logger="kvpilot"):
        assert not runtime.can_use_triton(cpu)
    assert "TRITON_INTERPRET=1 ignored" in caplog.text
    x, w = torch.randn(2, 32), torch.randn(32)  # the launcher takes the torch reference
    assert torch.equal(rms_norm(x, w, 1e-6)[0], layers.rms_norm(x, w, 1e-6)[0])
    with pytest.raises(runtime.UnsupportedTritonInterpreter, match=r"outside 3\.6-3\.9"):
        runtime.TritonKernel(lambda: None).on(torch.device("cpu"))


def snapshot_language() -> dict[str, object]:
    """Everything the interpreter patches: module functions of triton.language and its core, math
    and standard submodules (stdlib jit functions included), and the tensor class's members."""
    snap: dict[str, object] = {}
    for module in (tl, tl.core, tl.math, tl.standard):
        for name, value in vars(module).items():
            snap[f"{module.__name__}.{name}"] = value
    for name, value in vars(tl.core.tensor).items():
        snap[f"tensor.{name}"] = value
    return snap


def test_interpreted_launch_leaves_triton_language_as_it_was() -> None:
    before = snapshot_language()
    x, w = torch.randn(3, 64), torch.randn(64)
    out, _ = rms_norm(x, w, 1e-6, residual=torch.randn(3, 64))  # nested calls: tl.sum, cast_to
    assert torch.isfinite(out).all()
    after = snapshot_language()
    # Names the interpreter adds (its globals, copied into the modules it executes) are harmless;
    # a replaced one would make the next compilation call interpreter code.
    replaced = [k for k in before if after.get(k) is not before[k]]
    assert replaced == []


def test_can_use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.zeros(1)
    assert runtime.can_use_triton(cpu, cpu)  # the fixture set TRITON_INTERPRET=1
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not runtime.can_use_triton(cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "true")
    assert runtime.can_use_triton(cpu)
    assert not runtime.can_use_triton(cpu, torch.zeros(1, device="meta"))  # mixed devices


def test_interpreter_is_chosen_per_launch_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels were imported long before this test set TRITON_INTERPRET: they still run."""
    launched: list[str] = []
    kernel = runtime.TritonKernel(lambda: None)
    assert kernel.on(torch.device("cpu")) is kernel.on(torch.device("cpu"))
    original = runtime.TritonKernel.on

    def spy(self: runtime.TritonKernel, device: torch.device) -> object:
        launched.append(device.type)
        return original(self, device)

    monkeypatch.setattr(runtime.TritonKernel, "on", spy)
    x, w = torch.randn(2, 32), torch.randn(32)
    torch.testing.assert_close(rms_norm(x, w, 1e-6)[0], layers.rms_norm(x, w, 1e-6)[0])
    assert launched == ["cpu"]


@pytest.mark.parametrize(("n", "expected"), ((0, 1), (1, 1), (2, 2), (3, 4), (64, 64), (65, 128)))
def test_next_power_of_2(n: int, expected: int) -> None:
    assert runtime.next_power_of_2(n) == expected


def test_step_varying_arguments_are_not_specialized() -> None:
    """The attention kernel's sequence count changes every step: Triton must not compile a
    variant per class of it (1, multiple of 16, other) as steps bring them."""
    from kvpilot.engine.kernels.attention import _paged_attention_kernel

    assert _paged_attention_kernel.do_not_specialize == ("num_seqs",)
    jit_fn = _paged_attention_kernel.on(torch.device("cuda"))  # builds it; compiles nothing
    assert [p.name for p in jit_fn.params if p.do_not_specialize] == ["num_seqs"]
    assert runtime.compiled_variants()["_paged_attention_kernel"] == 0

    def kernel(x_ptr: object, n: int) -> None:
        pass

    with pytest.raises(ValueError, match=r"has no argument \['rows'\]"):
        runtime.TritonKernel(kernel, ("rows",))
