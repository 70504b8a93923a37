"""Chained block hashes: the one definition of a KV block's identity, shared by the engine's prefix
cache and by anything outside the engine that predicts what it holds (the router).

A block's hash covers its parent block's hash, its token ids, the request's cache_salt and the LoRA
adapter it was computed with (KV computed under one adapter is another adapter's, or the base
model's, wrong answer), so equal hashes mean equal prefixes (up to a 64-bit collision, which the
engine's prefix cache then catches by comparing the stored key). The hash must be the same in every
process and on every machine: Python's hash() of a str changes with PYTHONHASHSEED, so this uses
blake2b over a fixed byte layout instead. Change the layout only together with HASH_SCHEME:
subscribers compare it.

A request may mark its first blocks as shared (contract.tenancy.unsalted_blocks: a platform's
common system prompt): those hash without the salt, as a request without one, and every later block
with it, so the chain after the shared part is the salt's own.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Sequence

# v2 adds the adapter; a block without one hashes as in v1.
HASH_SCHEME = "blake2b64-v2"
_PERSON = b"kvpilot-block"
_NO_PARENT = b"\x00"
_NO_SALT = b"\x00"
_ADAPTER = b"\x02"  # leads the salt field when an adapter is named: v1 fields start 0x00 or 0x01


def hash_block(
    parent: int | None,
    token_ids: Sequence[int],
    cache_salt: str | None,
    lora_name: str | None = None,
) -> int:
    """The 64-bit hash of one full block (token_ids is exactly one block's tokens)."""
    # Blocks of one engine have a fixed size, but the count keeps layouts of different sizes apart.
    tokens = _block_layout(len(token_ids)).pack(len(token_ids), *token_ids)
    return _digest(_parent_bytes(parent) + tokens + _salt_bytes(cache_salt, lora_name))


def chain_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None,
    *,
    known: Sequence[int] = (),
    lora_name: str | None = None,
    unsalted_blocks: int = 0,
) -> list[int]:
    """The hash chain over every full block of token_ids. `known` is a prefix of the chain that
    is already computed (it is extended, not recomputed). The first `unsalted_blocks` blocks hash
    without cache_salt (block_salt). Each hash is hash_block's; the layout is built once per
    chain (the router hashes every request's prompt)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if unsalted_blocks < 0:
        raise ValueError(f"unsalted_blocks must be >= 0, got {unsalted_blocks}")
    hashes = list(known)
    pack = _block_layout(block_size).pack
    salted = _salt_bytes(cache_salt, lora_name)
    unsalted = _salt_bytes(None, lora_name)
    for index in range(len(hashes), len(token_ids) // block_size):
        start = index * block_size
        tokens = pack(block_size, *token_ids[start : start + block_size])
        salt = unsalted if index < unsalted_blocks else salted
        hashes.append(_digest(_parent_bytes(hashes[-1] if hashes else None) + tokens + salt))
    return hashes


def block_salt(cache_salt: str | None, index: int, unsalted_blocks: int) -> str | None:
    """The salt block `index` of a chain hashes with: none inside the shared prefix."""
    return None if index < unsalted_blocks else cache_salt


_UNKEYED = hashlib.blake2b(digest_size=8, person=_PERSON)


def _digest(data: bytes) -> int:
    digest = _UNKEYED.copy()
    digest.update(data)
    return int.from_bytes(digest.digest(), "little")


def _parent_bytes(parent: int | None) -> bytes:
    return _NO_PARENT if parent is None else b"\x01" + parent.to_bytes(8, "little")


def _salt_bytes(cache_salt: str | None, lora_name: str | None) -> bytes:
    salt = _NO_SALT if cache_salt is None else b"\x01" + cache_salt.encode("utf-8")
    if lora_name is None:
        return salt
    name = lora_name.encode("utf-8")
    return _ADAPTER + len(name).to_bytes(2, "little") + name + salt


@functools.lru_cache(maxsize=8)
def _block_layout(block_size: int) -> struct.Struct:
    return struct.Struct(f"<I{block_size}I")
