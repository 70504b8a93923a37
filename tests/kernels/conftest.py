"""Shared pieces of the kernel tests: the interpreter switch, tolerances and a paged-batch builder.

The kernels choose interpreter or compiler per launch from the tensors' device and read
TRITON_INTERPRET at call time (kvpilot.engine.kernels.runtime), so setting it per test here works
whatever imported the kernels first, and monkeypatch removes it again before tests in other folders
run.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from kvpilot.engine.attention.base import AttentionMetadata
from kvpilot.engine.kernels.runtime import TritonKernel

# vLLM's allclose defaults (tests/kernels/allclose_default.py): atol, rtol per dtype.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.bfloat16: (1e-3, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
    torch.float32: (1e-5, 1.3e-6),
}


@pytest.fixture(autouse=True)
def triton_interpreter(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU tests run the kernels under Triton's interpreter; GPU tests compile them."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def triton_launches(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Launches of each Triton kernel (by name) from here on in the test: which kernels an
    engine really ran."""
    launches: Counter[str] = Counter()
    original_on = TritonKernel.on

    def counting_on(self: TritonKernel, device: torch.device) -> Any:
        launches[self.__name__] += 1
        return original_on(self, device)

    monkeypatch.setattr(TritonKernel, "on", counting_on)
    return launches


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def load_bench_module() -> Iterator[Callable[[str], ModuleType]]:
    """Imports bench/NAME.py by path (bench/ is no package), and forgets it after the module."""
    loaded: list[str] = []

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses resolve their module through sys.modules
        loaded.append(name)
        spec.loader.exec_module(module)
        return module

    yield load
    for name in loaded:
        sys.modules.pop(name, None)


@pytest.fixture
def tiny_gqa_llama_dir(tmp_path: Path) -> Path:
    import json

    from tests.kernels.workloads import TINY_GQA_LLAMA

    (tmp_path / "config.json").write_text(json.dumps(TINY_GQA_LLAMA))
    return tmp_path


@pytest.fixture
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    return torch.device("cuda")


@pytest.fixture
def assert_close() -> Callable[[torch.Tensor, torch.Tensor], None]:
    def check(actual: torch.Tensor, expected: torch.Tensor) -> None:
        atol, rtol = TOLERANCES[expected.dtype]
        torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)

    return check


@dataclass(frozen=True)
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D], this step's new keys (already in the cache)
    value: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor
    meta: AttentionMetadata


def prepare_paged_batch(
    seqs: Sequence[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """seqs: (cached prefix length, query length) per sequence. Blocks are handed out shuffled, the
    whole cache is random (so a read through a wrong slot shows), and the new tokens' keys and
    values are written into their slots, as the engine does before attention."""
    gen = torch.Generator().manual_seed(seed)
    query_lens = [q for _, q in seqs]
    seq_lens = [p + q for p, q in seqs]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # a few never referenced
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + 2  # padded with 0 like the engine's tables
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    next_block = 0
    for s, n in enumerate(blocks_per_seq):
        tables[s, :n] = torch.tensor(perm[next_block : next_block + n], dtype=torch.int32)
        next_block += n

    # Random data is drawn where it will live: GPU-sized caches are too slow to fill on the CPU.
    is_cpu = torch.device(device).type == "cpu"
    dev_gen = gen if is_cpu else torch.Generator(device).manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=dev_gen, device=device).to(dtype)

    k_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = rand(num_blocks, block_size, num_kv_heads, head_dim)
    num_tokens = sum(query_lens)
    query = rand(num_tokens, num_heads, head_dim)
    key = rand(num_tokens, num_kv_heads, head_dim)
    value = rand(num_tokens, num_kv_heads, head_dim)
    slots = []
    for s, (prefix, q_len) in enumerate(seqs):
        for pos in range(prefix, prefix + q_len):
            slots.append(int(tables[s, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    flat_k[slot_mapping] = key
    flat_v[slot_mapping] = value
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
    )
    return PagedBatch(query, key, value, k_cache, v_cache, meta)


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return prepare_paged_batch
