"""What an engine tells the outside about its prefix cache: which block hashes it holds, as a
snapshot and then numbered deltas, with its load. The router keeps an exact index from these, and
tokenizes prompts with the engine's own tokenizer files to compute the same hashes
(kvpilot.contract.block_hash).

The stream a subscriber reads (GET KV_EVENTS_PATH; one JSON object per line, `kind` tells them
apart):
- `snapshot`: every block hash the engine holds now, as of delta number `seq`, with what a reader
  needs to compute the same hashes (block size, hash scheme, model name);
- `update`: delta `seq` (always the previous one + 1): hashes stored, hashes removed, and the load;
- `heartbeat`: nothing changed; the load, and the seq the reader should be at.
A reader that sees a seq other than the one it expects has missed something and must reconnect,
which starts with a fresh snapshot: it never keeps an index it cannot prove current. A server whose
reader fell too far behind sends a snapshot again instead of the deltas it no longer has.
"""

from __future__ import annotations

import msgspec

# The engine's stream of block-hash events (newline-delimited JSON: the messages below).
KV_EVENTS_PATH = "/kvpilot/v1/kv-events"
# One of the engine's tokenizer files, by name: what a router fetches to tokenize as it does.
TOKENIZER_FILE_PATH = "/kvpilot/v1/tokenizer/{name}"
# The files TOKENIZER_FILE_PATH serves (those the model has).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


class KvDelta(msgspec.Struct, frozen=True, array_like=True):
    """The engine core's change to its cached hash set over one step (two disjoint lists)."""

    stored: list[int]
    removed: list[int]


class Load(msgspec.Struct, frozen=True):
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    # LoRA adapters (contract.lora): those resident in the engine's max_loras slots now, which
    # serve a request at once (any other must first take a slot, evicting an idle one), and the
    # number of slots (0: adapters off).
    resident_loras: list[str] = []
    max_loras: int = 0
    # Sequences the engine runs at once (its --max-num-seqs; 0: unknown, an older engine): with
    # num_running at it, further requests wait in the engine.
    max_num_seqs: int = 0


class KvSnapshot(msgspec.Struct, frozen=True, tag="snapshot", tag_field="kind"):
    seq: int
    model: str
    block_size: int
    hash_scheme: str
    hashes: list[int]
    load: Load


class KvUpdate(msgspec.Struct, frozen=True, tag="update", tag_field="kind"):
    seq: int
    stored: list[int]
    removed: list[int]
    load: Load


class KvHeartbeat(msgspec.Struct, frozen=True, tag="heartbeat", tag_field="kind"):
    seq: int
    load: Load


KvMessage = KvSnapshot | KvUpdate | KvHeartbeat
