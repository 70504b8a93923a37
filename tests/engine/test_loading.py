"""Model loading: sharded safetensors, dummy weights, clear errors for missing or corrupt files,
KV-pool sizing from the memory budget, bfloat16 on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.gguf_convert import ModelFileError, gguf_to_hf_dir

from .reference import save_tiny_hf_model


def tiny_llama(tmp_path: Path) -> Path:
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.15,
    )
    return save_tiny_hf_model(cfg, tmp_path / "tiny")


def test_sharded_safetensors_load_like_a_single_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = tiny_llama(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(str(path))
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(model=str(path), dtype="float32").generate([[1, 2, 3, 4]], params)
    multi = LLM(model=str(sharded), dtype="float32").generate([[1, 2, 3, 4]], params)
    assert single[0].outputs[0].token_ids == multi[0].outputs[0].token_ids


def test_dummy_weights_from_a_config_only_directory(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path)
    config_only = tmp_path / "config-only"
    config_only.mkdir()
    (config_only / "config.json").write_text((path / "config.json").read_text())
    llm = LLM(model=str(config_only), load_format="dummy", dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4
    # (The linear layers hold oneDNN-packed copies on CPU; the embedding keeps a plain tensor.)
    weights = llm.engine.runner.model.model.embed_tokens.weight
    assert 0.01 < float(weights.std()) < 0.03  # N(0, 0.02), not zeros or garbage


def test_missing_and_corrupt_model_files_name_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere.gguf"
    with pytest.raises(ModelFileError, match=str(missing)):
        LLM(model=str(missing))
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00\x00\x00garbage" * 10)
    with pytest.raises(ModelFileError, match=str(corrupt)):
        gguf_to_hf_dir(corrupt)
    no_config = tmp_path / "empty-dir"
    no_config.mkdir()
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        LLM(model=str(no_config))
    path = tiny_llama(tmp_path)
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelFileError, match=r"model\.safetensors"):
        LLM(model=str(path))


def test_unsupported_architecture_is_a_clear_error(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported"):
        LLM(model=str(d))


def test_kv_pool_is_sized_from_the_cpu_budget(tmp_path: Path) -> None:
    path = tiny_llama(tmp_path)
    llm = LLM(model=str(path), dtype="float32", kv_cache_gib=0.01, block_size=16)
    # 2 (K,V) x 2 layers x 2 kv heads x 16 dims x 4 bytes x 16 tokens = 8 KiB per block
    assert llm.engine.num_blocks == int(0.01 * 2**30) // (8 * 1024)
    k_cache, v_cache = llm.engine.runner.kv_caches[0]
    assert k_cache.shape == (llm.engine.num_blocks, 16, 2, 16) and v_cache.dtype == torch.float32


def test_bfloat16_on_cpu_runs_the_real_model() -> None:
    llm = LLM(dtype="bfloat16", kv_cache_gib=0.1)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.bfloat16
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=16))[0].outputs[0]
    assert "Paris" in out.text


def test_float16_on_cpu_is_refused_with_a_reason() -> None:
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        LLM(dtype="float16")
