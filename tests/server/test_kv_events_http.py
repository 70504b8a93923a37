"""GET /kvpilot/v1/kv-events on a real server: the block hashes a request's prompt leaves in the
engine's prefix cache are those chain_block_hashes computes outside the engine."""

from __future__ import annotations

import json
import threading

import httpx

from kvpilot.contract.block_hash import HASH_SCHEME, chain_block_hashes
from kvpilot.engine.server.inprocess import InProcessServer

from .conftest import MAX_NUM_SEQS


def test_kv_events_carry_the_prompts_chained_hashes(server: InProcessServer) -> None:
    info = server.state.engine.info
    assert info is not None
    messages: list[dict] = []
    seen_update = threading.Event()

    def subscribe() -> None:
        with httpx.stream("GET", f"{server.url}/kvpilot/v1/kv-events", timeout=30) as response:
            assert response.headers["content-type"] == "application/x-ndjson"
            for line in response.iter_lines():
                messages.append(json.loads(line))
                if messages[-1]["kind"] == "update" and wanted <= stored():
                    seen_update.set()
                    return

    def stored() -> set[int]:
        held: set[int] = set()
        for message in messages:
            if message["kind"] == "snapshot":
                held = set(message["hashes"])
            elif message["kind"] == "update":
                held = (held - set(message["removed"])) | set(message["stored"])
        return held

    prompt = [(7 * i + 3) % 1000 + 100 for i in range(2 * info.block_size + 5)]
    wanted = set(chain_block_hashes(prompt, info.block_size, "kv-events-test"))
    assert len(wanted) == 2
    reader = threading.Thread(target=subscribe, daemon=True)
    reader.start()
    body = {
        "model": info.model_name,
        "prompt": prompt,
        "max_tokens": 2,
        "cache_salt": "kv-events-test",
    }
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
    assert seen_update.wait(30), messages
    snapshot = messages[0]
    assert snapshot["kind"] == "snapshot"
    assert (snapshot["block_size"], snapshot["hash_scheme"]) == (info.block_size, HASH_SCHEME)
    seqs = [m["seq"] for m in messages if m["kind"] == "update"]
    assert seqs == list(range(snapshot["seq"] + 1, snapshot["seq"] + 1 + len(seqs)))
    assert set(messages[-1]["load"]) == {
        "num_waiting", "num_running", "kv_cache_usage", "resident_loras", "max_loras",
        "max_num_seqs",
    }  # fmt: skip
    assert messages[-1]["load"]["max_num_seqs"] == snapshot["load"]["max_num_seqs"] == MAX_NUM_SEQS


def test_tokenizer_files_are_served(server: InProcessServer) -> None:
    got = httpx.get(f"{server.url}/kvpilot/v1/tokenizer/tokenizer.json", timeout=10)
    assert got.status_code == 200 and "model" in got.json()
    missing = httpx.get(f"{server.url}/kvpilot/v1/tokenizer/config.json", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
