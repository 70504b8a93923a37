"""Tensor parallelism on CPU (gloo): the split arithmetic, sharded loading (bytes per rank), and
greedy parity of TP=2 against TP=1 on tiny random transformers models, with prefix caching and
preemption on the way.

TP=1 is the single-device path the other parity tests hold to transformers; here TP=2 must give
the same tokens, and logprobs within LOGPROB_ATOL: the row-parallel all-reduce sums float32
partials in another order than one matmul does (observed ~5e-6).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.config import ModelConfig
from kvpilot.engine.executor.workers import WorkerDied
from kvpilot.engine.model.loader import build_model, load_safetensors_weights, read_hf_config
from kvpilot.engine.parallel.group import TPGroup
from kvpilot.engine.parallel.sharding import Shard, check_tensor_parallel_size

from .reference import save_tiny_hf_model
from .test_parity_tiny_models import llama_config, qwen2_config

LOGPROB_ATOL = 1e-4
MAX_TOKENS = 12


def llama(heads: int, kv_heads: int, *, tied: bool = False, vocab: int = 512) -> object:
    config = llama_config(heads, kv_heads, tied=tied)
    config.vocab_size = vocab
    return config


SHAPES = {
    "llama-kv-replicated": lambda: llama(4, 1),  # 1 KV head, held by both ranks
    "llama-tied-odd-vocab": lambda: llama(8, 2, tied=True, vocab=511),  # a padded vocab row
    "qwen2-bias-untied": qwen2_config,  # qkv bias; 6 heads and 2 KV heads split evenly
}


def model_config(cfg: dict) -> ModelConfig:
    return ModelConfig.from_hf_config(cfg)


# ---- the split arithmetic ----------------------------------------------------------------------
def smollm2_shape() -> ModelConfig:
    return model_config(
        {"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
         "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    )  # fmt: skip


def shape(heads: int, kv_heads: int, intermediate: int = 1536) -> ModelConfig:
    return model_config(
        {"model_type": "llama", "vocab_size": 100, "hidden_size": 64 * heads,
         "intermediate_size": intermediate, "num_hidden_layers": 1,
         "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cfg", "size", "gpus", "message"),
    [
        (shape(9, 3), 2, None, "tensor_parallel_size 2 does not divide the model's 9 attention"),
        (shape(6, 3), 2, None, "tensor_parallel_size 2 does not divide the model's 3 KV heads"),
        (shape(12, 3), 4, None, "tensor_parallel_size 4 is not a multiple of the model's 3 KV"),
        (shape(9, 3, 1000), 9, None, "9 does not divide the model's intermediate size 1000"),
        (shape(9, 3), 3, 2, "tensor_parallel_size 3 needs 3 GPUs, but 2 are visible"),
        (shape(9, 3), 0, None, "tensor_parallel_size must be >= 1, got 0"),
    ],
)
def test_invalid_sizes_name_the_numbers(
    cfg: ModelConfig, size: int, gpus: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel_size(cfg, size, num_gpus=gpus)


def test_kv_heads_split_or_replicate() -> None:
    cfg = smollm2_shape()  # 9 query heads, 3 KV heads, head_dim 64
    check_tensor_parallel_size(cfg, 3)
    shards = [Shard(cfg, r, 3) for r in range(3)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start) for s in shards] == [
        (3, 1, 0), (3, 1, 1), (3, 1, 2)
    ]  # fmt: skip
    assert [s.source_slice("model.layers.0.self_attn.q_proj.weight") for s in shards] == [
        (0, 0, 192), (0, 192, 384), (0, 384, 576)
    ]  # fmt: skip
    assert shards[2].source_slice("model.layers.0.mlp.down_proj.weight") == (1, 1024, 1536)
    assert shards[1].source_slice("model.layers.0.input_layernorm.weight") is None
    # Fewer KV heads than ranks: 2 KV heads over 4 ranks, each held by two neighbours.
    gqa = model_config(
        {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 8, "num_key_value_heads": 2}
    )  # fmt: skip
    check_tensor_parallel_size(gqa, 4)
    assert [Shard(gqa, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert [Shard(gqa, r, 4).source_slice("lm_head.weight") for r in range(4)] == [
        (0, 0, 3), (0, 3, 6), (0, 6, 9), (0, 9, 10)  # the last rank's third row is padding
    ]  # fmt: skip


# ---- sharded loading ---------------------------------------------------------------------------
def load_rank(path: Path, rank: int, size: int) -> tuple[torch.nn.Module, int]:
    cfg = model_config(read_hf_config(path))
    tp = None if size == 1 else TPGroup(rank, size)  # no collective runs while loading
    model = build_model(
        cfg, get_attention_backend("torch"), 64, torch.device("cpu"), torch.float32, tp=tp
    )
    return model, load_safetensors_weights(model, path)


def test_sharded_loading_reads_each_slice_once(tmp_path: Path) -> None:
    path = save_tiny_hf_model(llama(4, 1, vocab=511), tmp_path / "m")
    full, full_bytes = load_rank(path, 0, 1)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    assert full_bytes == sum(t.numel() * 4 for t in tensors.values())
    # Replicated on both ranks: the norms and (1 KV head < 2 ranks) k_proj/v_proj.
    replicated = sum(
        t.numel() * 4
        for name, t in tensors.items()
        if "norm" in name or ".k_proj." in name or ".v_proj." in name
    )
    ranks = [load_rank(path, r, 2) for r in range(2)]
    # Vocab 511 over 2 ranks: 256 rows of embed_tokens and of lm_head on rank 0, 255 on rank 1.
    row = 96 * 4
    assert [b for _, b in ranks] == [(full_bytes + replicated) // 2 + d for d in (row, -row)]
    assert sum(b for _, b in ranks) == full_bytes + replicated  # every other slice read once
    # And each rank holds exactly its slice of the full model.
    (r0, _), (r1, _) = ranks
    p0, p1, pf = (dict(m.named_parameters()) for m in (r0, r1, full))
    layer = "model.layers.1."
    q = 4 * 24 // 2
    assert torch.equal(
        p0[layer + "self_attn.qkv_proj.weight"][:q], pf[layer + "self_attn.qkv_proj.weight"][:q]
    )
    assert torch.equal(
        p1[layer + "self_attn.qkv_proj.weight"][:q],
        pf[layer + "self_attn.qkv_proj.weight"][q : 2 * q],
    )
    assert torch.equal(
        p0[layer + "self_attn.qkv_proj.weight"][q:],
        pf[layer + "self_attn.qkv_proj.weight"][2 * q :],
    )
    assert torch.equal(
        torch.cat([p0[layer + "mlp.down_proj.weight"], p1[layer + "mlp.down_proj.weight"]], 1),
        pf[layer + "mlp.down_proj.weight"],
    )
    lm = torch.cat([p0["lm_head.weight"], p1["lm_head.weight"]])
    assert torch.equal(lm[:511], pf["lm_head.weight"]) and not lm[511:].any()


# ---- greedy parity through real worker processes -----------------------------------------------
def prompts(num: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(num)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def generate(path: Path, tp: int, batch: list[list[int]], **kwargs: object) -> tuple[list, object]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", tensor_parallel_size=tp, **kwargs) as llm:
        outs = [o.outputs[0] for o in llm.generate(batch, params)]
        return outs, llm


def assert_same_generation(ours: list, ref: list) -> None:
    for a, b in zip(ours, ref, strict=True):
        assert a.token_ids == b.token_ids
        assert len(a.token_ids) == MAX_TOKENS
        for step, token in enumerate(a.token_ids):
            for t, ref_lp in b.logprobs[step].items():
                assert abs(a.logprobs[step][t].logprob - ref_lp.logprob) < LOGPROB_ATOL
            assert token in a.logprobs[step]


@pytest.mark.parametrize("name", list(SHAPES), ids=list(SHAPES))
def test_tp2_greedy_parity_with_tp1(name: str, tmp_path: Path) -> None:
    config = SHAPES[name]()
    path = save_tiny_hf_model(config, tmp_path / name)
    batch = prompts(3, (5, 19, 40), config.vocab_size)
    ref, _ = generate(path, 1, batch, num_blocks=64, max_num_batched_tokens=32)
    ours, llm = generate(path, 2, batch, num_blocks=64, max_num_batched_tokens=32)
    assert_same_generation(ours, ref)
    # Each rank read its own slices: half of every split tensor, all of the replicated ones.
    rank0, rank1 = llm.engine.runner.rank_bytes_loaded
    single = load_rank(path, 0, 1)[1]
    assert single < rank0 + rank1 < 2 * single


def test_prefix_caching_preemption_and_a_dead_rank_under_tp(tmp_path: Path) -> None:
    path = save_tiny_hf_model(llama(4, 1), tmp_path / "m")
    shared = prompts(7, (32,), 512)[0]
    batch = [shared + tail for tail in prompts(8, (8, 8, 8, 8), 512)]
    ref, _ = generate(path, 1, batch, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)
    # 12 blocks of 8 tokens hold 96 tokens; four sequences of 52 need 28 blocks: preemption.
    with LLM(model=str(path), dtype="float32", tensor_parallel_size=2, num_blocks=12,
             block_size=8) as llm:  # fmt: skip
        first = [o.outputs[0] for o in llm.generate(batch, params)]
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_hits > 0  # the shared 32 tokens, in full blocks
        again = [o.outputs[0] for o in llm.generate(batch[:1], params)]
        assert llm.engine.stats().prefix_cache_hits > stats.prefix_cache_hits
        assert_same_generation(first, ref)
        assert_same_generation(again, ref[:1])
        # A rank that dies while the engine idles is noticed (the serving loop polls this), and
        # the next step fails naming it instead of waiting on a collective.
        (worker,) = llm.engine.core.workers.pids
        os.kill(worker, signal.SIGKILL)
        died = None
        deadline = time.monotonic() + 10
        while died is None:
            assert time.monotonic() < deadline, "the dead rank went unnoticed"
            try:
                llm.engine.core.check_workers()
            except WorkerDied as exc:
                died = exc
            time.sleep(0.02)
        assert str(died) == f"tensor-parallel rank 1 (pid {worker}) was killed by signal 9"
        with pytest.raises(WorkerDied, match=rf"rank 1 \(pid {worker}\) was killed"):
            llm.generate(batch[:1], params)


def test_fp8_scales_under_tp_are_kept_per_rank_and_calibrated_together(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FP8 KV under tensor parallelism: each rank keeps the calibrated scales of its own KV heads;
    the next start reads them on every rank. Where one rank's are gone, every rank calibrates
    (they run the calibration's forward together, collectives inside), and the greedy tokens are
    those of the first start each time."""
    path = save_tiny_hf_model(llama(4, 2), tmp_path / "m")
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    kept = tmp_path / "cache" / "kv_scales"
    batch = prompts(5, (6, 17), 512)

    def start() -> list[list[int]]:
        outs, _ = generate(path, 2, batch, num_blocks=32, kv_cache_dtype="fp8")
        return [out.token_ids for out in outs]

    def written() -> dict[str, int]:
        return {file.name: file.stat().st_mtime_ns for file in kept.glob("*.safetensors")}

    first = start()
    after_first = written()
    assert len(after_first) == 2, after_first  # one file per rank's KV head
    assert start() == first
    assert written() == after_first, "a rank calibrated again although both had scales kept"
    gone = sorted(after_first)[0]
    (kept / gone).unlink()
    assert start() == first
    after_third = written()
    assert sorted(after_third) == sorted(after_first)
    assert all(after_third[name] != after_first[name] for name in after_first), (
        "the rank that still had its scales did not calibrate with the other"
    )
