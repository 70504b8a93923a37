"""Reading PEFT adapters (what is applied, what is refused and why), the adapter book's slots and
host-memory LRU, and the memory the operator sizes for adapters against what the engine
allocates."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from kvpilot.contract.sizing import lora_bytes
from kvpilot.engine.attention import get_attention_backend
from kvpilot.engine.config import LoRAConfig, ModelConfig
from kvpilot.engine.core.engine_core import adapter_bytes
from kvpilot.engine.lora.adapter import (
    AdapterError,
    AdapterNotFound,
    read_adapter,
    read_adapter_config,
)
from kvpilot.engine.lora.manager import LoRAManager
from kvpilot.engine.lora.slots import LoRASlots
from kvpilot.engine.model.llama import LlamaForCausalLM

from .lora_reference import make_peft_adapter
from .reference import save_tiny_hf_model
from .test_parity_tiny_models import llama_config


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_hf_model(llama_config(6, 2), tmp_path_factory.mktemp("base") / "model")


@pytest.fixture(scope="module")
def model_config(base: Path) -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((base / "config.json").read_text()))


@pytest.fixture(scope="module")
def adapter_dir(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapter")
    return make_peft_adapter(base, root / "a", rank=8, seed=5, alpha=4.0, use_rslora=True)


def test_an_adapter_reads_with_peft_scaling_folded_into_b(
    adapter_dir: Path, model_config: ModelConfig
) -> None:
    from safetensors.torch import load_file

    adapter = read_adapter("a", adapter_dir, model_config, max_rank=16)
    assert adapter.config.rank == 8 and adapter.config.use_rslora
    assert adapter.config.scaling == pytest.approx(4.0 / math.sqrt(8))
    raw = load_file(str(adapter_dir / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    a, b = adapter.weights[(1, "down_proj")]
    assert torch.equal(b, raw[key] * adapter.config.scaling)
    assert torch.equal(a, raw[key.replace("lora_B", "lora_A")])
    assert len(adapter.weights) == 2 * 7  # two layers, seven projections


def edited(adapter_dir: Path, tmp_path: Path, **changes: object) -> Path:
    copy = tmp_path / "edited"
    copy.mkdir()
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps(config | changes))
    (copy / "adapter_model.safetensors").write_bytes(
        (adapter_dir / "adapter_model.safetensors").read_bytes()
    )
    return copy


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"bias": "all"}, "biases"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"rank_pattern": {"q_proj": 4}}, "per-module ranks"),
        ({"layers_to_transform": [0]}, "layers_to_transform"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens"),
        ({"target_modules": "nothing_matches"}, "matches none"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": 32}, "above this engine's --max-lora-rank 16"),
        ({"r": 4}, "do not fit"),  # the weights are rank 8
        ({"lora_alpha": "x"}, "lora_alpha"),
    ],
)
def test_what_the_engine_cannot_apply_exactly_is_refused_with_the_reason(
    adapter_dir: Path, model_config: ModelConfig, tmp_path: Path, changes: dict, why: str
) -> None:
    with pytest.raises(AdapterError, match=why):
        read_adapter("a", edited(adapter_dir, tmp_path, **changes), model_config, max_rank=16)


def test_missing_and_damaged_files_say_which(
    adapter_dir: Path, model_config: ModelConfig, tmp_path: Path
) -> None:
    with pytest.raises(AdapterNotFound, match="No adapter found"):
        read_adapter("a", tmp_path / "absent", model_config, max_rank=16)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(AdapterNotFound, match=r"adapter_config\.json"):
        read_adapter("a", empty, model_config, max_rank=16)
    broken = edited(adapter_dir, tmp_path)
    (broken / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match=r"adapter_model\.safetensors is not a readable"):
        read_adapter("a", broken, model_config, max_rank=16)
    (broken / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="does not parse"):
        read_adapter_config(broken, 16)


def test_a_string_target_is_a_regex_over_module_names(adapter_dir: Path, tmp_path: Path) -> None:
    regex = edited(adapter_dir, tmp_path, target_modules=r".*\.(q_proj|v_proj)")
    assert read_adapter_config(regex, 16).target_modules == {"q_proj", "v_proj"}


def test_the_book_reads_on_a_thread_fills_free_slots_first_and_never_takes_a_busy_one(
    adapter_dir: Path, model_config: ModelConfig
) -> None:
    reads: list[str] = []

    def read(name: str, path: str) -> object:
        reads.append(name)
        return read_adapter(name, path, model_config, max_rank=16)

    book = LoRAManager(LoRAConfig(max_loras=2, max_cpu_loras=2), read)  # type: ignore[arg-type]
    for name in ("a", "b", "c"):
        book.add(read(name, str(adapter_dir)))
    assert list(book.paths) == ["a", "b", "c"]

    def wait_for_slot(name: str, busy: set[str]) -> int:
        deadline = time.monotonic() + 10
        while (slot := book.slot_for(name, busy)) is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return slot

    # Host memory holds two: "a", the least recently used, is read again on the thread.
    assert book.slot_for("a", busy=set()) is None
    assert wait_for_slot("a", busy=set()) == 0
    assert reads == ["a", "b", "c", "a"]
    assert book.slot_for("c", busy={"a"}) == 1  # a free slot before an idle one
    # "b" left host memory when "a" came back; every slot is busy anyway: it waits.
    assert book.slot_for("b", busy={"a", "c"}) is None
    assert wait_for_slot("b", busy={"c"}) == 0  # "a" idle now: its slot goes
    assert [(slot, adapter.name) for slot, adapter in book.take_fills()] == [
        (0, "a"), (1, "c"), (0, "b"),
    ]  # fmt: skip
    book.unregister("c")
    assert book.slots == ["b", None] and "c" not in book.paths
    book.close()


def test_the_memory_the_operator_sizes_is_what_the_engine_allocates(
    adapter_dir: Path, model_config: ModelConfig
) -> None:
    backend = get_attention_backend("torch")
    model = LlamaForCausalLM(model_config, backend, max_positions=64)
    lora = LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=5)
    slots = LoRASlots(
        model.model.layers, model_config, model.shard, 3, 8, torch.bfloat16, torch.device("cpu")
    )
    adapter = read_adapter("a", adapter_dir, model_config, max_rank=8)
    assert adapter_bytes(lora, model_config, itemsize=2) == slots.nbytes + 5 * adapter.nbytes
    assert lora_bytes(
        num_layers=1, hidden_size=1, q_size=1, kv_size=1, intermediate_size=1,
        max_rank=1, max_loras=0, max_cpu_loras=1, itemsize=2,
    ) == 4 * (3 + 1 + 2 + 1 + 1 + 4 + 2)  # fmt: skip


def test_a_request_for_an_adapter_whose_files_went_is_refused_not_left_waiting(
    base: Path, adapter_dir: Path, tmp_path: Path
) -> None:
    import shutil

    from kvpilot.engine import LLM, SamplingParams

    gone, kept = tmp_path / "gone", tmp_path / "kept"
    shutil.copytree(adapter_dir, gone)
    shutil.copytree(adapter_dir, kept)
    # Host memory holds one adapter: "gone", read first, leaves it when "kept" is read.
    lora = LoRAConfig(
        max_loras=1, max_cpu_loras=1, modules=(("gone", str(gone)), ("kept", str(kept)))
    )
    with LLM(str(base), lora=lora) as llm:
        shutil.rmtree(gone)
        with pytest.raises(ValueError, match="'gone' could not be read"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), lora_name="gone")
        answer = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), lora_name="kept")
        assert len(answer[0].outputs[0].token_ids) == 2
        assert not llm.engine.core.requests
