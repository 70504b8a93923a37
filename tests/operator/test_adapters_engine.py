"""The adapter sync's engine edge against a real `kvpilot serve` on loopback, started with the
command line the operator's builder gives a pod (a tiny random Llama, LoRA limits from
spec.engine.lora, the API key from the environment as the pod has it): what it lists, loads,
refuses and unloads is read by AdapterClient into the plan and status of adapters.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.operator.adapter_client import AdapterClient
from kvpilot.operator.adapters import WantedAdapter, build_report, plan
from kvpilot.operator.builders import build_engine_args
from kvpilot.operator.spec import API_KEY_ENV, parse_spec
from tests.engine.lora_reference import make_peft_adapter
from tests.engine.reference import save_tiny_hf_model
from tests.server.serve_process import ServeProcess, launch_serve

# Builds a model and two PEFT adapters, and starts an engine process: tens of seconds.
pytestmark = pytest.mark.slow

KEY = "engine-key"
NOW = 1.8e9


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    return save_tiny_hf_model(config, tmp_path_factory.mktemp("lora-engine") / "tiny")


@pytest.fixture(scope="module")
def adapter_dirs(model_dir: Path) -> dict[str, Path]:
    good = make_peft_adapter(
        model_dir, model_dir.parent / "sql", rank=8, seed=1, targets=["q_proj", "v_proj"]
    )
    # Rank 32 on an engine whose maxLoraRank is 8: files the engine refuses, saying why.
    too_big = make_peft_adapter(model_dir, model_dir.parent / "big", rank=32, seed=2)
    return {"sql": good, "big": too_big}


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[ServeProcess]:
    spec = parse_spec(
        {
            "model": {"uri": f"file://{model_dir}"},
            "engine": {"lora": {"maxLoras": 1, "maxLoraRank": 8}, "kvCacheBytes": "16Mi"},
        }
    )
    args = build_engine_args(spec, "tiny")[1:]
    # The pod's command line, listening where the test can reach it instead.
    for flag in ("--host", "--port"):
        at = args.index(flag)
        del args[at : at + 2]
    with launch_serve(*args, env={API_KEY_ENV: KEY}) as served:
        yield served


async def test_a_real_engine_lists_loads_refuses_and_unloads_as_the_sync_expects(
    engine: ServeProcess, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    client = AdapterClient()
    try:
        refused = await client.list_loaded(engine.url, None)
        assert isinstance(refused, str) and "HTTP 401" in refused
        assert await client.list_loaded(engine.url, KEY) == {}

        sql = WantedAdapter("sql", f"file://{adapter_dirs['sql']}", str(adapter_dirs["sql"]))
        big = WantedAdapter("big", f"file://{adapter_dirs['big']}", str(adapter_dirs["big"]))
        nowhere = WantedAdapter("gone", f"file://{tmp_path}/none", f"{tmp_path}/none")
        wanted = [sql, big, nowhere]
        actions = plan(wanted, {"p0": {}}, {}, NOW)
        results = [await client.run(engine.url, KEY, action) for action in actions]
        assert [result.status for result in results] == [200, 400, 404]
        listing = await client.list_loaded(engine.url, KEY)
        assert listing == {"sql": str(adapter_dirs["sql"])}
        # Loaded as the spec wants: nothing more to do for it.
        assert plan([sql], {"p0": listing}, {}, NOW) == []

        report = build_report(wanted, ["p0"], {"p0": listing}, {}, results, {}, NOW)
        states = {a["name"]: a["replicas"][0] for a in report.adapters}
        assert states["sql"] == {"pod": "p0", "state": "Loaded"}
        assert states["big"]["state"] == states["gone"]["state"] == "Failed"
        assert states["big"]["message"].startswith("HTTP 400: ")
        assert "32" in states["big"]["message"]  # the engine says which rank is too large
        assert states["gone"]["message"].startswith("HTTP 404: ")
        assert report.condition is not None and report.condition.reason == "AdapterFailed"

        # Removed from the spec: unloaded.
        (unload,) = plan([], {"p0": listing}, {}, NOW)
        result = await client.run(engine.url, KEY, unload)
        assert (result.status, result.is_done) == (200, True)
        assert await client.list_loaded(engine.url, KEY) == {}
    finally:
        await client.aclose()
    log = "".join(engine.log)
    assert KEY not in log and json.dumps(KEY) not in log
