"""The router tokenizes exactly as the engine does, with the engine's own files: fetched from a
replica (GET /kvpilot/v1/tokenizer/{file}) into a private directory and loaded like the engine
loads them."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import Any

import httpx

from kvpilot.engine.server.kv_events import TOKENIZER_FILES


async def fetch_tokenizer(client: httpx.AsyncClient, replica_url: str) -> Any:
    directory = Path(tempfile.mkdtemp(prefix="kvpilot-router-tokenizer-"))
    found = 0
    for name in TOKENIZER_FILES:
        response = await client.get(f"{replica_url}/kvpilot/v1/tokenizer/{name}", timeout=30)
        if response.status_code == 404:
            continue
        response.raise_for_status()
        (directory / name).write_bytes(response.content)
        found += 1
    if not found:
        return None
    return await asyncio.to_thread(_load, directory)


def _load(directory: Path) -> Any:
    from transformers import AutoTokenizer  # as the engine's loader does

    return AutoTokenizer.from_pretrained(str(directory))
