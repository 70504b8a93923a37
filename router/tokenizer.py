"""The router tokenizes exactly as the engine does, with the engine's own files: fetched from a
replica (GET /kvpilot/v1/tokenizer/{file}) into a private directory and loaded like the engine
loads them.

Every routed request is tokenized, so encode() skips transformers' Python wrapper, asks the
Rust tokenizer for ids alone (no offsets), and tokenizes what a chat prompt repeats (the system
prompt, earlier turns) once: the same ids (tests/router/test_router_tokenizer.py)."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import httpx

from kvpilot.contract.kv_events import TOKENIZER_FILE_PATH, TOKENIZER_FILES


async def fetch_tokenizer(
    client: httpx.AsyncClient, replica_url: str, headers: dict[str, str] | None = None
) -> Any:
    directory = Path(tempfile.mkdtemp(prefix="kvpilot-router-tokenizer-"))
    found = 0
    for name in TOKENIZER_FILES:
        response = await client.get(
            replica_url + TOKENIZER_FILE_PATH.format(name=name), headers=headers, timeout=30
        )
        if response.status_code == 404:
            continue
        response.raise_for_status()
        (directory / name).write_bytes(response.content)
        found += 1
    if not found:
        return None
    return await asyncio.to_thread(_load, directory)


# transformers resolves its names lazily, and two threads resolving `AutoTokenizer` at once (two
# models' tokenizers loading together) can fail with "cannot import name": one at a time.
_TRANSFORMERS_IMPORT = threading.Lock()


def _load(directory: Path) -> Any:
    with _TRANSFORMERS_IMPORT:
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
    other attribute (the chat template, decode, special tokens) is the wrapped tokenizer's.

    The Rust tokenizer first cuts the text at its added tokens (<|im_start|>, ...) and tokenizes
    each piece between them on its own. Where that cut is one this class can make exactly the
    same way (see piece_splitter), a chat prompt is tokenized piece by piece with the pieces'
    ids kept (LRU): a conversation's system prompt and earlier turns, rendered again on every
    turn, are tokenized once."""

    def __init__(self, tokenizer: Any, backend: Any, max_cached_tokens: int = 1 << 20) -> None:
        self.wrapped = tokenizer
        self._backend = backend
        # What transformers sets before each of its own encodes (no truncation, no padding,
        # special tokens split or not as configured): set once, since no one else uses it.
        backend.no_truncation()
        backend.no_padding()
        backend.encode_special_tokens = bool(getattr(tokenizer, "split_special_tokens", False))
        self._splitter = piece_splitter(backend)
        self._added_ids = {t.content: i for i, t in backend.get_added_tokens_decoder().items()}
        self._pieces: OrderedDict[str, list[int]] = OrderedDict()
        # Bounded by the ids held (about 40 bytes each, with the text): 40 MB at most.
        self.max_cached_tokens = max_cached_tokens
        self._cached_tokens = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._splitter is None or add_special_tokens:
            return self._encode(text, add_special_tokens)
        ids: list[int] = []
        start = 0
        for added in self._splitter.finditer(text):
            if added.start() > start:
                ids += self._piece(text[start : added.start()])
            ids.append(self._added_ids[added.group()])
            start = added.end()
        if start < len(text):
            ids += self._piece(text[start:])
        return ids

    def _piece(self, piece: str) -> list[int]:
        ids = self._pieces.get(piece)
        if ids is not None:
            self._pieces.move_to_end(piece)
            return ids
        ids = self._encode(piece, False)
        self._pieces[piece] = ids
        self._cached_tokens += len(ids)
        while self._cached_tokens > self.max_cached_tokens:
            self._cached_tokens -= len(self._pieces.popitem(last=False)[1])
        return ids

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)
        return encoding[0].ids

    def __getattr__(self, name: str) -> Any:
        return getattr(self.wrapped, name)

    def __len__(self) -> int:
        return len(self.wrapped)


# Pre-tokenizers whose split of a piece does not depend on where the piece sits in the text.
_PIECEWISE_PRE_TOKENIZERS = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace"}


def piece_splitter(backend: Any) -> re.Pattern[str] | None:
    """A pattern finding the added tokens where the Rust tokenizer cuts the text (leftmost, the
    longest there, as its Aho-Corasick matcher does), or None when pieces could tokenize
    differently alone: a normalizer, a pre-tokenizer that looks at the position (a prefix space
    on the first word), BPE dropout, added tokens that take in neighbouring spaces or match
    only whole words, or special tokens read as text (split_special_tokens)."""
    if backend.normalizer is not None or backend.encode_special_tokens:
        return None
    if getattr(backend.model, "dropout", None) not in (None, 0.0):
        return None
    state = json.loads(backend.pre_tokenizer.__getstate__()) if backend.pre_tokenizer else {}
    steps = state.get("pretokenizers", [state]) if state.get("type") == "Sequence" else [state]
    for step in steps:
        if step and (
            step.get("type") not in _PIECEWISE_PRE_TOKENIZERS or step.get("add_prefix_space")
        ):
            return None
    added = list(backend.get_added_tokens_decoder().values())
    if not added or any(t.lstrip or t.rstrip or t.single_word for t in added):
        return None
    contents = sorted({t.content for t in added}, key=len, reverse=True)
    return re.compile("|".join(re.escape(c) for c in contents))
