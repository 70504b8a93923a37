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


def _mapped_file(address: int) -> str | None:
    """The file whose memory map holds `address` in this process (None: anonymous memory)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return fields[5] if len(fields) > 5 else None
    return None


def test_weights_are_the_files_memory_map_not_a_copy(tmp_path: Path) -> None:
    """A parameter whose file tensor has the run's dtype is that tensor, mapped from the file;
    merged ones (qkv, gate_up) are copies; every value equals the copying loader's."""
    from kvpilot.engine.attention import get_attention_backend
    from kvpilot.engine.config import ModelConfig
    from kvpilot.engine.model.loader import (
        build_model,
        load_model_from_files,
        load_safetensors_weights,
        read_hf_config,
    )

    path = tiny_llama(tmp_path)
    cfg = ModelConfig.from_hf_config(read_hf_config(path))
    backend, cpu = get_attention_backend("torch"), torch.device("cpu")
    model, num_bytes = load_model_from_files(cfg, backend, 64, cpu, torch.float32, path)
    weights = str((path / "model.safetensors").resolve())
    layer = model.model.layers[0]
    for mapped in (model.model.embed_tokens.weight, layer.self_attn.o_proj.weight,
                   layer.mlp.down_proj.weight, layer.input_layernorm.weight):  # fmt: skip
        assert _mapped_file(mapped.data_ptr()) == weights
    for merged in (layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight):
        assert _mapped_file(merged.data_ptr()) != weights
    copied = build_model(cfg, backend, 64, cpu, torch.float32)
    assert num_bytes == load_safetensors_weights(copied, path) > 0
    ours, theirs = dict(model.named_parameters()), dict(copied.named_parameters())
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert not any(p.requires_grad for p in ours.values())
    assert torch.equal(model.cos_sin_cache, copied.cos_sin_cache)
    # A run in another dtype converts (a copy), and the file stays as it was.
    bf16, _ = load_model_from_files(cfg, backend, 64, cpu, torch.bfloat16, path)
    assert bf16.model.layers[0].self_attn.o_proj.weight.dtype == torch.bfloat16
    assert _mapped_file(bf16.model.layers[0].self_attn.o_proj.weight.data_ptr()) != weights
