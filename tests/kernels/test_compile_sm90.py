"""Every kernel variant the launchers issue on a GPU compiles to an sm_90 (H100) cubin, on this CPU.

The interpreter runs the kernels' logic, but not the compiled path: native fp16/bf16 dots (the
interpreter gets fp32 ones), scf.while/for lowering, layouts and register allocation. Triton's
bundled ptxas compiles without a GPU, so each launch is captured here and compiled for sm_90 instead
of being run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvpilot.engine.kernels import activation, attention, kv_cache, rms_norm, rotary
from kvpilot.engine.kernels.runtime import TritonKernel
from kvpilot.engine.model import layers

pytestmark = pytest.mark.slow

POINTER_TYPES = {
    torch.float16: "*fp16",
    torch.bfloat16: "*bf16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.uint8: "*u8",  # an FP8 cache's codes
}


class CompileForSm90:
    """Stands in for a kernel's launcher: compiles for sm_90 what would have been launched."""

    def __init__(self, kernel: TritonKernel, compiled: list[dict[str, Any]]) -> None:
        self.kernel = kernel
        self.compiled = compiled

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def compile_launch(*args: Any, **kwargs: Any) -> None:
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            from triton.runtime.jit import JITFunction

            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
            # What the launcher sets for a CUDA tensor rather than for this CPU one.
            kwargs["INTERPRET"] = False
            fn = JITFunction(self.kernel.fn)
            values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
            if "UPCAST" in kwargs:
                kwargs["UPCAST"] = values["UPCAST"] = values["q_ptr"].dtype == torch.float32
            signature: dict[str, str] = {}
            attrs: dict[tuple[int, ...], list[list[Any]]] = {}
            for i, name in enumerate(fn.arg_names):
                value = values[name]
                if name in kwargs:
                    signature[name] = "constexpr"
                elif isinstance(value, torch.Tensor):
                    signature[name] = POINTER_TYPES[value.dtype]
                    if value.data_ptr() % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                elif isinstance(value, bool):
                    signature[name] = "i1"
                elif isinstance(value, int):
                    signature[name] = "i32" if abs(value) < 2**31 else "i64"
                    if value % 16 == 0:
                        attrs[(i,)] = [["tt.divisibility", 16]]
                else:
                    signature[name] = "fp32"
            constexprs = {name: kwargs[name] for name in fn.arg_names if name in kwargs}
            source = ASTSource(fn, signature, constexprs, attrs)
            binary = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            self.compiled.append(
                {
                    "name": self.kernel.__name__,
                    "cubin": binary.asm["cubin"],
                    "ptx": binary.asm["ptx"],
                }
            )

        return compile_launch


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> list[dict[str, Any]]:
    pytest.importorskip("triton.backends.nvidia", reason="triton's NVIDIA backend is not installed")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a cold compile, every time
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when it is unset
    records: list[dict[str, Any]] = []
    monkeypatch.setattr(TritonKernel, "on", lambda self, device: CompileForSm90(self, records))
    return records


@pytest.mark.parametrize(
    ("dtype", "heads", "head_dim", "seqs", "num_splits"),
    (
        (torch.bfloat16, (32, 8), 128, ((30, 1), (100, 1)), 1),  # 8B decode
        (torch.bfloat16, (32, 8), 128, ((0, 40), (70, 1), (5, 20)), 1),  # 8B mixed batch
        (torch.float16, (9, 3), 64, ((0, 40), (70, 1)), 1),  # SmolLM2-135M, group 3
        (torch.bfloat16, (32, 8), 128, ((3000, 1),), 4),  # split-K and the merge kernel
        (torch.float32, (4, 2), 64, ((10, 5),), 1),  # fp32: ieee dots
    ),
    ids=("decode-bf16", "mixed-bf16", "gqa3-fp16", "splitk-bf16", "fp32"),
)
def test_attention_compiles(
    compiled: list[dict[str, Any]],
    paged_batch: Callable[..., Any],
    dtype: torch.dtype,
    heads: tuple[int, int],
    head_dim: int,
    seqs: tuple[tuple[int, int], ...],
    num_splits: int,
) -> None:
    batch = paged_batch(
        seqs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    scale = 1 / math.sqrt(head_dim)
    attention.paged_attention(
        batch.query, batch.k_cache, batch.v_cache, batch.meta, scale, num_splits=num_splits
    )
    query_lens = [q for _, q in seqs]
    # A mixed batch: a pass over its decodes (decode tiles), then one over its chunks.
    passes = 2 if max(query_lens) > 1 and min(query_lens) == 1 else 1
    per_pass = ["_paged_attention_kernel"] + (["_merge_splits_kernel"] * (num_splits > 1))
    assert [c["name"] for c in compiled] == per_pass * passes
    assert all(len(c["cubin"]) > 1000 for c in compiled)
    if dtype != torch.float32 and len(seqs) > 1 and seqs[0][1] > 1:
        # Prefill tiles of fp16/bf16 run on Hopper's tensor cores.
        assert "wgmma" in compiled[-1]["ptx"]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=("e4m3fn", "e5m2"))
def test_fp8_cache_kernels_compile(
    compiled: list[dict[str, Any]], paged_batch: Callable[..., Any], fp8: torch.dtype
) -> None:
    """An FP8 cache: both passes of a mixed bfloat16 batch with split-K, and the KV write."""
    batch = paged_batch(((0, 40), (70, 1)), num_heads=32, num_kv_heads=8, head_dim=128,
                        block_size=16, dtype=torch.bfloat16)  # fmt: skip
    scales = torch.full((8,), 0.05)
    k8, v8 = batch.k_cache.to(fp8), batch.v_cache.to(fp8)
    attention.paged_attention(batch.query, k8, v8, batch.meta, 0.1, num_splits=2,
                              k_scale=scales, v_scale=scales)  # fmt: skip
    kv_cache.write_kv(batch.key, batch.value, k8, v8, batch.meta.slot_mapping,
                      k_scale=scales, v_scale=scales)  # fmt: skip
    per_pass = ["_paged_attention_kernel", "_merge_splits_kernel"]
    assert [c["name"] for c in compiled] == per_pass * 2 + ["_write_kv_kernel"]
    assert all(len(c["cubin"]) > 1000 for c in compiled)
    # The decoded tiles keep the prefill pass on Hopper's tensor cores.
    assert "wgmma" in compiled[2]["ptx"]


def test_layer_kernels_and_kv_write_compile(compiled: list[dict[str, Any]]) -> None:
    dtype = torch.bfloat16
    x = torch.randn(5, 4096).to(dtype)
    weight = torch.ones(4096, dtype=dtype)
    rms_norm.rms_norm(x, weight, 1e-5)
    rms_norm.rms_norm(x, weight, 1e-5, residual=x.clone())
    activation.silu_and_mul(torch.randn(5, 2 * 1024).to(dtype))
    cache = layers.rope_cos_sin_cache(128, 64, 500000.0, layers.RopeScaling())
    qkv = torch.randn(5, 48, 128).to(dtype)
    rotary.apply_rotary(qkv[:, :32], qkv[:, 32:40], torch.arange(5), cache)
    k_cache = torch.zeros(4, 16, 8, 128, dtype=dtype)
    kv_cache.write_kv(qkv[:, 32:40], qkv[:, 40:48], k_cache, k_cache.clone(), torch.arange(5))
    assert [c["name"] for c in compiled] == [
        "_rms_norm_kernel",
        "_rms_norm_kernel",
        "_silu_and_mul_kernel",
        "_rotary_kernel",
        "_write_kv_kernel",
    ]
    assert all(len(c["cubin"]) > 1000 for c in compiled)
