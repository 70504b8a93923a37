"""The router tokenizes exactly as the engine does, with the engine's own files: fetched from a
replica (GET /kvpilot/v1/tokenizer/{file}) into a private directory and loaded like the engine
loads them.

Every routed request is tokenized, so encode() skips transformers' Python wrapper and asks the
Rust tokenizer for ids alone (no offsets): a third of the tokenizing CPU on a 250-token chat
prompt (bench/RESULTS.md), the same ids (tests/router/test_router_tokenizer.py)."""

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

    return fast_encoding(AutoTokenizer.from_pretrained(str(directory)))


def fast_encoding(tokenizer: Any) -> Any:
    """The tokenizer, with encode() straight to its Rust tokenizer where it has one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "encode_batch_fast"):
        return tokenizer  # a Python (slow) tokenizer, or a `tokenizers` without ids-only encoding
    return FastEncoding(tokenizer, backend)


class FastEncoding:
    """A transformers fast tokenizer whose encode(text) calls the Rust tokenizer directly; every
    other attribute (the chat template, decode, special tokens) is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Any, backend: Any) -> None:
        self.wrapped = tokenizer
        self._backend = backend
        # What transformers sets before each of its own encodes (no truncation, no padding,
        # special tokens split or not as configured): set once, since no one else uses it.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding[0].ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def __len__(self) -> int:
        return len(self.wrapped)
