"""Where kernels run: the per-launch choice of compiler or interpreter, and what the interpreter
leaves behind in a process that also compiles (a GPU test session)."""

from __future__ import annotations

import pytest
import torch
import triton.language as tl

from kvpilot.engine.kernels import runtime
from kvpilot.engine.kernels.rms_norm import rms_norm
from kvpilot.engine.model import layers


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
