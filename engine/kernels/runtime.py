"""Where a Triton kernel runs: compiled on CUDA tensors, interpreted on CPU tensors.

`triton.jit` decides between compiler and interpreter once, at decoration time, from
TRITON_INTERPRET, so whichever module happened to import the kernels first would fix the mode for
the whole process. We decide per launch instead, from the device of the tensors: CUDA tensors get
the compiled kernel, CPU tensors the interpreter, and the interpreter only when TRITON_INTERPRET=1
asks for it (it is far too slow to be the default CPU path; without it the launchers fall back to
the torch reference).

Triton has no public way to choose per launch, so the interpreter side leans on Triton internals:
`triton.runtime.interpreter.InterpretedFunction` (its `fn` and `rewrite()`) and the private
`_patch_lang(fn)`, whose scope object has `restore()`. They are used only within the Triton
releases they were checked against (INTERPRETER_TRITON_RANGE, with their shape checked too); any
other Triton gets the compiled kernels on CUDA as usual, and the torch reference instead of the
interpreter on CPU (a direct interpreted launch raises UnsupportedTritonInterpreter).
tests/kernels/test_runtime.py fails while the installed Triton is outside the range.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

log = logging.getLogger("kvpilot")

_TRUTHY = ("1", "true", "yes", "on")
# First and last Triton (major, minor) whose interpreter.py the code below was read against and
# tested on (3.6: the GPU image; 3.9: CI). Widen only after re-reading both uses of _patch_lang in
# the new release's triton/runtime/interpreter.py.
INTERPRETER_TRITON_RANGE = ((3, 6), (3, 9))


class UnsupportedTritonInterpreter(RuntimeError):
    """The installed Triton's interpreter is not one this module's workarounds were checked on."""


def interpreter_problem_for(version: str, interpreter: ModuleType) -> str | None:
    """Why interpreted launches cannot run on this Triton (its __version__ and its
    triton.runtime.interpreter module), or None."""
    low, high = INTERPRETER_TRITON_RANGE
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or not low <= (int(found[1]), int(found[2])) <= high:
        return (
            f"Triton {version} is outside {low[0]}.{low[1]}-{high[0]}.{high[1]}, the releases "
            "whose interpreter internals kvpilot.engine.kernels.runtime was checked against"
        )
    patch = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    function = getattr(interpreter, "InterpretedFunction", None)
    if not callable(patch) or list(inspect.signature(patch).parameters) != ["fn"]:
        return "triton.runtime.interpreter._patch_lang(fn) is gone or changed its signature"
    if not callable(getattr(scope, "restore", None)):
        return "the scope triton.runtime.interpreter._patch_lang returns has no restore()"
    if not isinstance(function, type) or not callable(getattr(function, "rewrite", None)):
        return "triton.runtime.interpreter.InterpretedFunction.rewrite() is gone"
    if "fn" not in inspect.signature(function).parameters:
        return "triton.runtime.interpreter.InterpretedFunction(fn) changed its signature"
    return None


@functools.cache
def interpreter_problem() -> str | None:
    """interpreter_problem_for the installed Triton (None: interpreted launches are supported)."""
    import triton
    from triton.runtime import interpreter

    return interpreter_problem_for(triton.__version__, interpreter)


@functools.cache
def _warn_interpreter_unsupported(problem: str) -> None:
    log.warning("TRITON_INTERPRET=1 ignored, CPU tensors take the torch reference: %s", problem)


def is_interpret_enabled() -> bool:
    """TRITON_INTERPRET=1: run kernels on CPU tensors under Triton's interpreter (tests, debug)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUTHY


@functools.cache
def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def can_use_triton(*tensors: torch.Tensor) -> bool:
    """All tensors share one device a kernel can run on: CUDA, or the CPU under the interpreter."""
    device = tensors[0].device
    if any(t.device != device for t in tensors[1:]) or not has_triton():
        return False
    if device.type == "cuda":
        return True
    if device.type != "cpu" or not is_interpret_enabled():
        return False
    problem = interpreter_problem()
    if problem is not None:
        _warn_interpreter_unsupported(problem)
    return problem is None


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


class TritonKernel:
    """One kernel source with two launchers: `kernel.on(device)[grid](*args, **constexprs)`.

    do_not_specialize: integer arguments whose values change from step to step. Triton compiles a
    variant of a kernel for each class of each integer argument (1, a multiple of 16, any other)
    when it first meets it: mid-serving, a request would wait for that compile (~1 s)."""

    def __init__(self, fn: Callable[..., None], do_not_specialize: tuple[str, ...] = ()) -> None:
        params = inspect.signature(fn).parameters
        unknown = [name for name in do_not_specialize if name not in params]
        if unknown:
            raise ValueError(f"{fn.__name__} has no argument {unknown}")
        self.fn = fn
        self.do_not_specialize = do_not_specialize
        self._compiled: Any = None
        self._interpreted: Any = None
        _KERNELS.append(self)

    @property
    def __name__(self) -> str:
        return self.fn.__name__

    def on(self, device: torch.device) -> Any:
        if device.type == "cuda":
            if self._compiled is None:
                from triton import JITFunction

                self._compiled = JITFunction(
                    self.fn, do_not_specialize=list(self.do_not_specialize) or None
                )
            return self._compiled
        if (problem := interpreter_problem()) is not None:
            raise UnsupportedTritonInterpreter(f"cannot interpret {self.__name__}: {problem}")
        if self._interpreted is None:
            from triton.runtime.interpreter import InterpretedFunction

            self._interpreted = _Interpreted(InterpretedFunction(self.fn), self.fn.__globals__)
        return self._interpreted


class _Interpreted:
    """Launches an interpreted kernel with triton.language's own jit helpers interpreted too."""

    def __init__(self, fn: Any, kernel_globals: dict[str, Any]) -> None:
        self.fn = fn
        self.kernel_globals = kernel_globals

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            with _interpretable_jit_functions(self.kernel_globals):
                self.fn[grid](*args, **kwargs)

        return launch


# Keyed by id(): hashing a JITFunction computes its cache key, which walks its globals mid-swap.
_TWINS: dict[int, Any] = {}


@functools.cache
def _nested_interpreted_class() -> type:
    # Only reached through TritonKernel.on, after interpreter_problem() vouched for these internals.
    from triton.runtime.interpreter import InterpretedFunction, _patch_lang

    class NestedInterpreted(InterpretedFunction):
        """Triton's own nested-call path patches triton.language for the interpreter and never
        undoes it, which breaks any later compilation in the process; this one restores."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            scope = _patch_lang(self.fn)
            try:
                return self.rewrite()(*args, **kwargs)
            finally:
                scope.restore()

    return NestedInterpreted


def _interpreted_twin(jit_fn: Any) -> Any:
    twin = _TWINS.get(id(jit_fn))
    if twin is None:
        twin = _TWINS[id(jit_fn)] = _nested_interpreted_class()(jit_fn.fn)
    return twin


@contextlib.contextmanager
def _interpretable_jit_functions(kernel_globals: dict[str, Any]) -> Iterator[None]:
    """tl.max, tl.sum, tl.cdiv, tl.zeros... are themselves @triton.jit functions, made compiled or
    interpreted when triton.language is first imported, and our helpers are always compiled. The
    interpreter cannot call compiled functions, so for the duration of one launch swap in
    interpreted twins, in triton.language and in the kernel's module (the interpreter recognizes its
    reduction helpers by identity, and swapping the module attributes keeps that consistent)."""
    from triton import JITFunction
    from triton.runtime.interpreter import InterpretedFunction

    twin_class = _nested_interpreted_class()
    namespaces = [
        vars(m) for name, m in list(sys.modules.items()) if name.startswith("triton.language")
    ]
    namespaces.append(kernel_globals)
    swapped: list[tuple[dict[str, Any], str, Any]] = []
    try:
        for namespace in namespaces:
            for name, value in list(namespace.items()):
                if isinstance(value, JITFunction | InterpretedFunction) and not isinstance(
                    value, twin_class
                ):
                    swapped.append((namespace, name, value))
                    namespace[name] = _interpreted_twin(value)
        yield
    finally:
        for namespace, name, value in reversed(swapped):
            namespace[name] = value


def triton_kernel(
    fn: Callable[..., None] | None = None, *, do_not_specialize: tuple[str, ...] = ()
) -> Any:
    """Decorator used instead of @triton.jit, so that the import order never decides the mode:
    `@triton_kernel`, or `@triton_kernel(do_not_specialize=(...))` (see TritonKernel)."""
    if fn is None:
        return lambda f: TritonKernel(f, do_not_specialize)
    return TritonKernel(fn)


_KERNELS: list[TritonKernel] = []


def compiled_variants() -> dict[str, int]:
    """Per kernel, the variants compiled so far in this process (on every device): what a
    warm-up must leave unchanged while requests run."""
    counts = {}
    for kernel in _KERNELS:
        jit_fn = kernel._compiled
        caches = getattr(jit_fn, "device_caches", {}) if jit_fn is not None else {}
        # Each device's entry is a tuple whose first item is its kernel cache (Triton 3.x).
        counts[kernel.__name__] = sum(len(entry[0]) for entry in caches.values())
    return counts


def triton_helper(fn: Callable[..., Any]) -> Any:
    """A device function called from kernels: always a compiled JITFunction (whatever
    TRITON_INTERPRET says), swapped for an interpreted twin while an interpreted kernel of the same
    module runs."""
    from triton import JITFunction

    return JITFunction(fn)
