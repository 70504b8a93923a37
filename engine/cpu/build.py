"""Compiles csrc/cpu_ops.c, csrc/linear.c and csrc/lora.c into one library for this machine and
loads it, once per process.

The library is cached under the kvpilot cache directory, keyed by the sources, the compiler, the
flags and the CPU (the build targets -march=native), so a second start and every other process on
the machine reuse it. A build is written to a temporary file and renamed into place, so concurrent
starts never load half a file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger("kvpilot")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_ops.c", CSRC / "linear.c", CSRC / "lora.c")
BASE_FLAGS = (
    "-O3",
    "-march=native",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp-simd",
    "-fPIC",
    "-shared",
)
# The storage dtypes the kernels are built for, and their function-name suffixes.
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_PTR, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
Signature = tuple[list[type], type | None]
# Every entry point of SOURCES: (argument types in the C parameter order, result type), set
# on the loaded library so that a call with too few arguments or a wrong type raises in Python
# instead of reading garbage in C. Pointers (const or not, T * for either dtype) are tensor
# data_ptr()s. The typed kernels exist once per dtype suffix (TYPED). Every row is checked against
# the preprocessed C source by tests/engine/test_cpu_ctypes.py.
TYPED: dict[str, Signature] = {
    # query, k_cache, v_cache, block_tables, seq_lens, out; num_seqs, num_heads, num_kv_heads,
    # head_dim, block_size, table_stride, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; scale
    "paged_decode": ([_PTR] * 6 + [_I64] * 12 + [_F32], None),
    # query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out; num_seqs, num_heads,
    # num_kv_heads, head_dim, block_size, table_stride, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; scale
    # -> 0, or 1 when its work list could not be allocated
    "paged_attention": ([_PTR] * 7 + [_I64] * 12 + [_F32], _INT),
    # q, k, positions, cos_sin; num_positions; q_out, k_out; tokens, num_heads, num_kv_heads,
    # head_dim, q_stride, k_stride -> 0, or 1 for a position outside the table
    "rotary": ([_PTR] * 4 + [_I64] + [_PTR] * 2 + [_I64] * 6, _INT),
    # key, value, k_cache, v_cache, slots; num_slots, tokens, row, k_stride, v_stride -> 0, or 1
    # for a slot outside the cache
    "write_kv": ([_PTR] * 5 + [_I64] * 5, _INT),
    # x, residual (NULL: none), sum, squares; tokens, hidden
    "rms_norm_prepare": ([_PTR] * 4 + [_I64] * 2, None),
    # sum, variance, weight; eps; out; tokens, hidden
    "rms_norm_apply": ([_PTR] * 3 + [_F32] + [_PTR] + [_I64] * 2, None),
    # x, residual (NULL: none), sum, weight; eps; out; tokens, hidden, lanes -> 0, or 1 when the
    # lanes are out of range or a row buffer could not be allocated
    "rms_norm_fused": ([_PTR] * 4 + [_F32] + [_PTR] + [_I64] * 3, _INT),
    # gate_up, out; tokens, inter, stride
    "silu_and_mul": ([_PTR] * 2 + [_I64] * 3, None),
    # x, packed weight, bias (NULL: none), y; M, N, K, x_stride, y_stride -> 0, or 1 when this
    # build has no kernel for the dtype (linear.c)
    "linear": ([_PTR] * 4 + [_I64] * 5, _INT),
    # out, x, lora_a, lora_b, token_slots, bounds; tokens, num_slots, num_sub, rank, K, N,
    # x_stride, out_stride -> 0, 1 for a slot outside the stack or a rank above 256, or 2 when
    # its scratch memory could not be allocated (lora.c)
    "lora_add": ([_PTR] * 6 + [_I64] * 8, _INT),
}
UNTYPED: dict[str, Signature] = {
    "kvpilot_openmp_threads": ([], _INT),
    "kvpilot_set_openmp_threads": ([_INT], _INT),
    "kvpilot_linear_available": ([], _INT),
    # the output size (bytes) from which linear.c writes y with streaming stores
    "kvpilot_linear_stream_bytes": ([], _I64),
    # x, out; rows, n, lanes
    "torch_order_sums": ([_PTR] * 2 + [_I64] * 3, None),
    # x, out; rows, n, stride
    "argmax_rows_f32": ([_PTR] * 2 + [_I64] * 3, None),
}


def signatures() -> dict[str, Signature]:
    """Every exported function's full name -> (argtypes, restype)."""
    typed = {
        f"{name}_{suffix}": signature
        for name, signature in TYPED.items()
        for suffix in SUFFIXES.values()
    }
    return {**typed, **UNTYPED}


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compile(compiler: str, out: Path, extra_flags: tuple[str, ...]) -> list[str]:
    """Builds the library into `out`; returns the flags used (OpenMP when the compiler has it)."""
    last_error = ""
    for openmp in (["-fopenmp"], []):
        flags = [*BASE_FLAGS, *extra_flags, *openmp]
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            proc = subprocess.run(
                [compiler, *flags, *map(str, SOURCES), "-o", str(target), "-lm"],
                capture_output=True,
                text=True,
                timeout=300,
            )
            if proc.returncode == 0:
                os.replace(target, out)
                return flags
            last_error = proc.stderr.strip()[-2000:]
    names = " and ".join(source.name for source in SOURCES)
    raise RuntimeError(f"{compiler} could not build {names}: {last_error}")


@functools.cache
def load_library(extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled kernels, or None (logged once) when this machine cannot build them.

    extra_flags: added to the compiler's flags (the tests build the portable, non-AVX-512 path with
    -mno-avx512f).

    With OpenMP the library's NEEDED libgomp.so.1 resolves to the one torch already loaded, so the
    kernels share torch's thread pool and its torch.set_num_threads setting."""
    from kvpilot.engine.model.gguf_convert import cache_root

    compiler = c_compiler()
    if compiler is None:
        log.warning("no C compiler found: the CPU kernels fall back to plain torch")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        key = hashlib.sha256(
            "\0".join(
                [
                    *(source.read_text() for source in SOURCES),
                    compiler,
                    version,
                    " ".join([*BASE_FLAGS, *extra_flags]),
                    _cpu_signature(),
                ]
            ).encode()
        ).hexdigest()[:16]
        out = cache_root() / "cpu_kernels" / key / "cpu_ops.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            flags = _compile(compiler, out, extra_flags)
            log.info("built the CPU kernels (%s) at %s", " ".join(flags), out)
        lib = ctypes.CDLL(str(out))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU kernels fall back to plain torch: %s", exc)
        return None
    for name, (argtypes, restype) in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib
