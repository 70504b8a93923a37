"""Compiles csrc/cpu_ops.c, csrc/linear.c and csrc/lora.c into one library for this machine and
loads it, once per process.

A library prebuilt for a named instruction set (ISAS, `python -m kvpilot.engine.prepare
--kernels-dir`, e.g. at image build) is taken from a read-only directory when this CPU has every
feature it needs and it was built from these sources (prebuilt_dir()/<source_key()>/<isa>/
cpu_ops.so, the richest ISA first). Only for a CPU none of them fits (or sources no build matches)
is the library compiled here, for -march=native, and cached under the kvpilot cache directory
keyed by the sources, the compiler, the flags and the CPU, so a second start and every other
process on the machine reuse it. A build is written to a temporary file and renamed into place,
so concurrent starts never load half a file.
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
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("kvpilot")

# Where prebuilt kernel libraries are looked up (read-only; see the module docstring).
PREBUILT_ENV = "KVPILOT_PREBUILT_KERNELS"
PREBUILT_PACKAGE_DIR = Path(__file__).with_name("prebuilt")
LIBRARY_NAME = "cpu_ops.so"

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_ops.c", CSRC / "linear.c", CSRC / "lora.c")
NATIVE_FLAGS = ("-march=native",)
PORTABLE_FLAGS = (
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-fopenmp-simd",
    "-fPIC",
    "-shared",
)
BASE_FLAGS = (*PORTABLE_FLAGS[:1], *NATIVE_FLAGS, *PORTABLE_FLAGS[1:])


@dataclass(frozen=True)
class Isa:
    """An instruction set a library can be prebuilt for: its compiler flags and the
    /proc/cpuinfo flags a CPU needs to run what they emit."""

    name: str
    march: tuple[str, ...]
    cpu_flags: frozenset[str]


_X86_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "abm"})
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
# Richest first: the first one a CPU runs is the one it loads. The kernels branch on __AVX2__,
# __FMA__, __AVX512F__, __AVX512BW__ and __AVX512BF16__ (csrc/*.c), so these three cover every path.
ISAS: tuple[Isa, ...] = (
    Isa("avx512bf16", ("-march=x86-64-v4", "-mavx512bf16"), _X86_V4 | {"avx512_bf16"}),
    Isa("avx512", ("-march=x86-64-v4",), _X86_V4),
    Isa("avx2", ("-march=x86-64-v3",), _X86_V3),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)
# The storage dtypes the kernels are built for, and their function-name suffixes.
SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# The FP8 cache dtypes the attention kernels read, and the suffix each adds to the query's:
# paged_decode_bf16_e4m3 reads an e4m3 cache for a bfloat16 query.
FP8_SUFFIXES = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
_PTR, _I64, _F32, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
Signature = tuple[list[type], type | None]
# Every entry point of SOURCES: (argument types in the C parameter order, result type), set
# on the loaded library so that a call with too few arguments or a wrong type raises in Python
# instead of reading garbage in C. Pointers (const or not, T * for either dtype) are tensor
# data_ptr()s. The typed kernels exist once per dtype suffix (TYPED). Every row is checked against
# the preprocessed C source by tests/engine/test_cpu_ctypes.py.
TYPED: dict[str, Signature] = {
    # query, k_cache, v_cache, block_tables, seq_lens, out; num_seqs, num_heads, num_kv_heads,
    # head_dim, block_size, table_stride, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; scale; k_scale,
    # v_scale (per kv head, float32; NULL: 1)
    "paged_decode": ([_PTR] * 6 + [_I64] * 12 + [_F32] + [_PTR] * 2, None),
    # query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out; num_seqs, num_heads,
    # num_kv_heads, head_dim, block_size, table_stride, k_sb, k_ss, k_sh, v_sb, v_ss, v_sh; scale;
    # k_scale, v_scale -> 0, or 1 when its work list could not be allocated
    "paged_attention": ([_PTR] * 7 + [_I64] * 12 + [_F32] + [_PTR] * 2, _INT),
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
# The typed kernels that also exist per FP8 cache dtype (same signature).
FP8_KERNELS = ("paged_decode", "paged_attention")
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
    fp8 = {
        f"{name}_{suffix}_{cache}": TYPED[name]
        for name in FP8_KERNELS
        for suffix in SUFFIXES.values()
        for cache in FP8_SUFFIXES.values()
    }
    return {**typed, **fp8, **UNTYPED}


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


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    line = next((line for line in info.splitlines() if line.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def source_key() -> str:
    """What a prebuilt library must have been built from: the sources, the portable flags and the
    entry points' signatures (a library from other sources is never loaded)."""
    parts = [
        *(source.read_text() for source in SOURCES),
        " ".join(PORTABLE_FLAGS),
        repr(sorted((name, repr(sig)) for name, sig in signatures().items())),
    ]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def prebuilt_dir() -> Path:
    """$KVPILOT_PREBUILT_KERNELS, else the package's own prebuilt/ directory."""
    return Path(os.environ.get(PREBUILT_ENV) or PREBUILT_PACKAGE_DIR)


def find_prebuilt(
    directory: Path, flags: frozenset[str], key: str | None = None
) -> tuple[Isa, Path] | None:
    """The richest prebuilt library under directory that a CPU with these flags runs."""
    base = directory / (key or source_key())
    for isa in ISAS:
        path = base / isa.name / LIBRARY_NAME
        if isa.cpu_flags <= flags and path.is_file():
            return isa, path
    return None


def build_prebuilt(directory: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """Compiles the library for each named ISA into directory/<source_key()>/<isa>/ (the layout
    find_prebuilt reads); returns name -> library. Raises RuntimeError without a compiler."""
    by_name = {isa.name: isa for isa in ISAS}
    unknown = sorted(set(names) - set(by_name))
    if unknown:
        raise ValueError(f"unknown instruction sets {unknown}: choose from {list(ISA_NAMES)}")
    compiler = c_compiler()
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC) to prebuild the CPU kernels")
    base = directory / source_key()
    built = {}
    for name in names:
        out = base / name / LIBRARY_NAME
        out.parent.mkdir(parents=True, exist_ok=True)
        _compile(compiler, out, by_name[name].march, base=PORTABLE_FLAGS)
        built[name] = out
    return built


def _compile(
    compiler: str,
    out: Path,
    extra_flags: tuple[str, ...],
    base: tuple[str, ...] = BASE_FLAGS,
) -> list[str]:
    """Builds the library into `out`; returns the flags used (OpenMP when the compiler has it)."""
    last_error = ""
    for openmp in (["-fopenmp"], []):
        flags = [*base, *extra_flags, *openmp]
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

    prebuilt = None if extra_flags else find_prebuilt(prebuilt_dir(), cpu_flags())
    if prebuilt is not None:
        try:
            lib = ctypes.CDLL(str(prebuilt[1]))
            log.info("using the CPU kernels prebuilt for %s at %s", prebuilt[0].name, prebuilt[1])
            return _bind(lib)
        except OSError as exc:
            log.warning("the prebuilt CPU kernels at %s did not load: %s", prebuilt[1], exc)
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
        out = cache_root() / "cpu_kernels" / key / LIBRARY_NAME
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            flags = _compile(compiler, out, extra_flags)
            log.info("built the CPU kernels (%s) at %s", " ".join(flags), out)
        lib = ctypes.CDLL(str(out))
        log.info("using the CPU kernels built for this CPU at %s", out)
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU kernels fall back to plain torch: %s", exc)
        return None
    return _bind(lib)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Sets every entry point's argtypes and restype (see TYPED)."""
    for name, (argtypes, restype) in signatures().items():
        fn = getattr(lib, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return lib
