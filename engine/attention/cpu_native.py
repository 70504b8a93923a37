"""The 'cpu' attention backend: decodes read the paged cache directly in a small C kernel
(csrc/paged_decode.c); prefill chunks take the torch reference path (SDPA per sequence).

On CPU the torch path's decode cost is mostly memory traffic of its own making: gathering every
sequence's blocks into a contiguous copy, then copying again for the batched matmuls. The C kernel
reads each cached key and value once, in place, with an online softmax per block.

The kernel is compiled on first use with the host's C compiler (`cc`, or $CC) for this machine's
instruction set and cached under the kvpilot cache directory, keyed by the source, the flags and the
CPU. Without a compiler, or for shapes and dtypes the kernel does not cover, everything goes to the
torch reference: choosing this backend never changes what the engine can run, only how fast.
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

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.attention.torch_ref import (
    decode_rows,
    paged_attention_reference,
    write_kv_reference,
)

log = logging.getLogger("kvpilot")

SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
BASE_FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
MAX_GROUP, MAX_HEAD_DIM, MAX_BLOCK = 16, 256, 256
_FUNCTIONS = {torch.float32: "paged_decode_f32", torch.bfloat16: "paged_decode_bf16"}


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(keep)))


def _compile(compiler: str, out: Path) -> list[str]:
    """Builds the library into `out`; returns the flags used (OpenMP when the compiler has it)."""
    last_error = ""
    for extra in (["-fopenmp"], []):
        flags = [*BASE_FLAGS, *extra]
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            proc = subprocess.run(
                [compiler, *flags, str(SOURCE), "-o", str(target), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if proc.returncode == 0:
                os.replace(target, out)  # atomic: concurrent builders never see half a file
                return flags
            last_error = proc.stderr.strip()[-2000:]
    raise RuntimeError(f"{compiler} could not build {SOURCE.name}: {last_error}")


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, or None (logged once) when this machine cannot build it."""
    from kvpilot.engine.model.gguf_convert import cache_root

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler found: CPU decode attention uses the torch reference path")
        return None
    try:
        version = subprocess.run(
            [compiler, "--version"], capture_output=True, text=True, timeout=30
        ).stdout
        key = hashlib.sha256(
            "\0".join(
                [SOURCE.read_text(), compiler, version, " ".join(BASE_FLAGS), _cpu_signature()]
            ).encode()
        ).hexdigest()[:16]
        out = cache_root() / "cpu_kernels" / key / "paged_decode.so"
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            flags = _compile(compiler, out)
            log.info("built the CPU decode-attention kernel (%s) at %s", " ".join(flags), out)
        lib = ctypes.CDLL(str(out))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("CPU decode attention uses the torch reference path: %s", exc)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name in _FUNCTIONS.values():
        fn = getattr(lib, name)
        fn.argtypes = [ptr] * 6 + [i64] * 12 + [ctypes.c_float]
        fn.restype = None
    lib.kvpilot_openmp_threads.restype = ctypes.c_int
    return lib


def is_supported(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in _FUNCTIONS
        and k_cache.dtype == query.dtype
        and v_cache.dtype == query.dtype
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
        and head_dim % 16 == 0
        and head_dim <= MAX_HEAD_DIM
        and k_cache.shape[1] <= MAX_BLOCK
        and k_cache.stride(-1) == 1
        and v_cache.stride(-1) == 1
    )


def paged_decode(
    lib: ctypes.CDLL,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query [S, H, D] (one token per sequence) -> [S, H, D]; block_tables [S, *] int32, seq_lens
    [S] int32, every length >= 1."""
    query = query.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    seq_lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(query)
    num_seqs, num_heads, head_dim = query.shape
    getattr(lib, _FUNCTIONS[query.dtype])(
        query.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_seqs,
        num_heads,
        k_cache.shape[2],
        head_dim,
        k_cache.shape[1],
        block_tables.stride(0),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        scale,
    )
    return out


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        self.lib = load_library()

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        write_kv_reference(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if self.lib is None or not is_supported(query, k_cache, v_cache):
            return paged_attention_reference(query, k_cache, v_cache, meta, scale)
        if meta.is_decode_only:
            return paged_decode(
                self.lib, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale
            )
        rows, token_idx = decode_rows(meta)
        out = paged_attention_reference(query, k_cache, v_cache, meta, scale, skip_rows=rows)
        if rows:
            rows_t = torch.tensor(rows)
            out[token_idx] = paged_decode(
                self.lib,
                query[token_idx],
                k_cache,
                v_cache,
                meta.block_tables[rows_t],
                meta.seq_lens[rows_t],
                scale,
            )
        return out
