"""LoRA adapters over the engine's HTTP API, as vLLM serves them, on SmolLM2 with adapters made by
PEFT: the model list with parents, requests by adapter name (through the openai client), runtime
load and unload with vLLM's answers (400 for bad files naming what is wrong, 404 for an unknown
adapter or path, 409 for an adapter in use), streams on other adapters untouched by loads and
unloads, and the adapter metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry

from kvpilot.contract.lora import LOAD_LORA_PATH, UNLOAD_LORA_PATH, load_success, unload_success
from kvpilot.engine import CacheConfig, EngineConfig, SchedulerConfig
from kvpilot.engine.config import LoRAConfig
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.state import ServerState

from ..engine.lora_reference import make_peft_adapter

MAX_LORAS = 2


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("smollm2-adapters")
    base = gguf_to_hf_dir(bundled_gguf_path())
    return {
        f"team-{i}": make_peft_adapter(base, root / f"team-{i}", rank=8, seed=i, scale=0.5)
        for i in range(4)
    }


@pytest.fixture(scope="module")
def lora_server(adapters: dict[str, Path]) -> Iterator[InProcessServer]:
    config = EngineConfig(
        max_model_len=1024,
        cache=CacheConfig(kv_cache_gib=0.25),
        scheduler=SchedulerConfig(max_num_seqs=32),
        lora=LoRAConfig(
            max_loras=MAX_LORAS,
            max_lora_rank=16,
            max_cpu_loras=3,
            modules=(("team-0", str(adapters["team-0"])),),
            allow_runtime_updating=True,
        ),
    )
    engine = AsyncEngine(config, registry=CollectorRegistry(), core_threads=1)
    engine.start()
    assert engine.wait_loaded(timeout=300), f"the engine did not load: {engine.error}"
    live = serve_in_thread(ServerState(engine))
    yield live
    live.stop()
    engine.shutdown()


def post(live: InProcessServer, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{live.url}{path}", json=body, timeout=120)


def greedy(live: InProcessServer, model: str, content: str, max_tokens: int = 12) -> str:
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none")
    answer = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    assert answer.model == model
    return answer.choices[0].message.content or ""


def test_adapters_are_models_with_the_base_as_parent_and_answer_by_name(
    lora_server: InProcessServer, adapters: dict[str, Path]
) -> None:
    listed = httpx.get(f"{lora_server.url}/v1/models").json()["data"]
    base = listed[0]["id"]
    assert [(m["id"], m["parent"]) for m in listed] == [(base, None), ("team-0", base)]
    assert listed[1]["root"] == str(adapters["team-0"])
    assert httpx.get(f"{lora_server.url}/v1/models/team-0").json()["parent"] == base
    question = "Name a color."
    assert greedy(lora_server, "team-0", question) != greedy(lora_server, base, question)
    missing = post(lora_server, "/v1/completions", {"model": "team-9", "prompt": "hi"})
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_the_block_event_stream_reports_the_slots_and_the_resident_adapters(
    lora_server: InProcessServer,
) -> None:
    from kvpilot.contract.kv_events import KV_EVENTS_PATH

    greedy(lora_server, "team-0", "Hi", max_tokens=2)
    with httpx.stream("GET", f"{lora_server.url}{KV_EVENTS_PATH}", timeout=30) as events:
        lines = events.iter_lines()
        snapshot = json.loads(next(lines))
        heartbeat = json.loads(next(lines))
    assert snapshot["kind"] == "snapshot" and snapshot["load"]["max_loras"] == MAX_LORAS
    assert "team-0" in heartbeat["load"]["resident_loras"]


def test_runtime_load_and_unload_answer_as_vllm_does(
    lora_server: InProcessServer, adapters: dict[str, Path], tmp_path: Path
) -> None:
    url = lora_server.url
    loaded = post(
        lora_server, LOAD_LORA_PATH, {"lora_name": "team-1", "lora_path": str(adapters["team-1"])}
    )
    assert (loaded.status_code, loaded.text) == (200, load_success("team-1"))
    assert "team-1" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert greedy(lora_server, "team-1", "Hello") != greedy(lora_server, "team-0", "Hello")

    again = post(
        lora_server, LOAD_LORA_PATH, {"lora_name": "team-1", "lora_path": str(adapters["team-1"])}
    )
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    nowhere = post(
        lora_server, LOAD_LORA_PATH, {"lora_name": "x", "lora_path": str(tmp_path / "none")}
    )
    assert nowhere.status_code == 404
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text(
        (adapters["team-2"] / "adapter_config.json").read_text()
    )
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 100)
    bad = post(lora_server, LOAD_LORA_PATH, {"lora_name": "bad", "lora_path": str(corrupt)})
    assert bad.status_code == 400 and "adapter_model.safetensors" in bad.json()["error"]["message"]
    too_big = tmp_path / "rank32"
    too_big.mkdir()
    config = json.loads((adapters["team-2"] / "adapter_config.json").read_text())
    (too_big / "adapter_config.json").write_text(json.dumps(config | {"r": 32}))
    ranked = post(lora_server, LOAD_LORA_PATH, {"lora_name": "big", "lora_path": str(too_big)})
    assert ranked.status_code == 400 and "--max-lora-rank 16" in ranked.json()["error"]["message"]
    for name in ("has space", "", "-dash"):
        assert (
            post(lora_server, LOAD_LORA_PATH, {"lora_name": name, "lora_path": "/x"}).status_code
            == 400
        )
    assert post(lora_server, LOAD_LORA_PATH, {"lora_name": "a"}).status_code == 400
    # The base model serves on after every refusal.
    base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    assert greedy(lora_server, base, "Hello")

    unloaded = post(lora_server, UNLOAD_LORA_PATH, {"lora_name": "team-1"})
    assert (unloaded.status_code, unloaded.text) == (200, unload_success("team-1"))
    assert post(lora_server, UNLOAD_LORA_PATH, {"lora_name": "team-1"}).status_code == 404
    gone = post(lora_server, "/v1/completions", {"model": "team-1", "prompt": "hi"})
    assert gone.status_code == 404


def test_an_adapter_in_use_is_not_unloaded_until_its_requests_finish(
    lora_server: InProcessServer, adapters: dict[str, Path]
) -> None:
    assert (
        post(
            lora_server,
            LOAD_LORA_PATH,
            {"lora_name": "team-2", "lora_path": str(adapters["team-2"])},
        ).status_code
        == 200
    )

    async def run() -> tuple[int, str]:
        client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
        stream = await client.completions.create(
            model="team-2",
            prompt="Count:",
            max_tokens=60,
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        first = await anext(aiter(stream))
        async with httpx.AsyncClient() as http:
            refused = await http.post(
                f"{lora_server.url}{UNLOAD_LORA_PATH}", json={"lora_name": "team-2"}
            )
        text = first.choices[0].text + "".join([c.choices[0].text async for c in stream])
        return refused.status_code, text

    status, text = asyncio.run(run())
    assert status == 409 and text
    assert post(lora_server, UNLOAD_LORA_PATH, {"lora_name": "team-2"}).status_code == 200


def test_streams_on_other_adapters_go_on_while_adapters_load_and_unload(
    lora_server: InProcessServer, adapters: dict[str, Path]
) -> None:
    async def stream(client: openai.AsyncOpenAI, model: str, i: int) -> str:
        answer = await client.completions.create(
            model=model,
            prompt=f"Story {i}:",
            max_tokens=24,
            stream=True,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in answer])

    async def churn(http: httpx.AsyncClient) -> list[int]:
        statuses = []
        for _ in range(2):
            body = {"lora_name": "team-3", "lora_path": str(adapters["team-3"])}
            statuses.append(
                (await http.post(f"{lora_server.url}{LOAD_LORA_PATH}", json=body)).status_code
            )
            statuses.append(
                (
                    await http.post(
                        f"{lora_server.url}{UNLOAD_LORA_PATH}", json={"lora_name": "team-3"}
                    )
                ).status_code
            )
        return statuses

    async def run() -> tuple[list[str], list[int]]:
        base = httpx.get(f"{lora_server.url}/v1/models").json()["data"][0]["id"]
        client = openai.AsyncOpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
        async with httpx.AsyncClient(timeout=120) as http:
            streams = [stream(client, "team-0" if i % 2 else base, i) for i in range(16)]
            *texts, statuses = await asyncio.gather(*streams, churn(http))
        return texts, statuses

    texts, statuses = asyncio.run(run())
    assert statuses == [200, 200, 200, 200]
    assert len(texts) == 16 and all(texts)


def test_the_adapter_metrics_name_what_runs_and_count_each_adapter(
    lora_server: InProcessServer,
) -> None:
    greedy(lora_server, "team-0", "Hi", max_tokens=3)
    deadline = time.monotonic() + 30
    while True:
        metrics = lora_server.metrics()
        info = [k for k in metrics if k.startswith("vllm:lora_requests_info{")]
        if (
            info
            == ["vllm:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"]
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.1)
    assert info == [
        "vllm:lora_requests_info{max_lora=2,running_lora_adapters=,waiting_lora_adapters=}"
    ]
    assert metrics[info[0]] > 1e9  # the wall-clock time of the last change
    assert metrics["kvpilot:lora_requests_total{lora_name=team-0}"] >= 1
    assert metrics["kvpilot:lora_generation_tokens_total{lora_name=team-0}"] >= 3
    assert metrics["kvpilot:lora_prompt_tokens_total{lora_name=team-0}"] >= 1


def test_the_load_routes_do_not_exist_without_runtime_updating(server: InProcessServer) -> None:
    assert post(server, LOAD_LORA_PATH, {"lora_name": "a", "lora_path": "/x"}).status_code == 404
    assert post(server, UNLOAD_LORA_PATH, {"lora_name": "a"}).status_code == 404


def test_an_adapter_keeps_to_a_schema_and_makes_forced_tool_calls(
    lora_server: InProcessServer,
) -> None:
    """Structured outputs and tools work on an adapter's requests as on the base model's: the
    grammar masks the adapter's logits."""
    import jsonschema

    from .test_structured_outputs import TOOL_PROMPT, TOOL_SCHEMAS, TOOLS, _check_calls

    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="none")
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 16},
            "days": {"type": "integer", "minimum": 1, "maximum": 30},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model="team-0",
        messages=[{"role": "user", "content": "Plan a trip as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}},
        max_tokens=100,
        temperature=0.0,
    )
    assert answer.model == "team-0" and answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content or ""), schema)
    called = client.chat.completions.create(
        model="team-0",
        messages=TOOL_PROMPT,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        max_tokens=80,
        temperature=0.0,
    )
    assert called.choices[0].finish_reason == "tool_calls"
    assert _check_calls(called.choices[0].message, set(TOOL_SCHEMAS))
