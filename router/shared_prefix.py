"""Prefixes the platform shares across tenants (an InferenceService's spec.sharedPrefixes: a
common system prompt, a shared instruction block): how many of a prompt's tokens lie inside one.

Every tenant's blocks are salted with the tenant (contract.tenancy.tenant_salt), except the full
blocks of a shared prefix (contract.tenancy.unsalted_blocks): those hold the same KV for everyone,
and one copy serves all tenants. A prefix is recognised by its tokens, as the engine renders them:
each text as a completion prompt and as a chat's system message, so a match is exact and a
prompt that only resembles it is salted whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpilot.contract import errors
from kvpilot.contract.openai import ChatCompletionRequest, CompletionRequest
from kvpilot.engine.server.preprocess import PromptLimits, chat_request_prompt, completion_prompts

_ANY = 1 << 31


def shared_prefix_token_ids(texts: Sequence[str], tokenizer: Any) -> tuple[tuple[int, ...], ...]:
    """Each text's token ids as a completion prompt starts (but its last token) and as a chat's
    system message does (the chat template's framing of that message included); the longest
    first."""
    limits = PromptLimits("", _ANY, _ANY, None)
    found: set[tuple[int, ...]] = set()
    for text in texts:
        try:
            completion = CompletionRequest(model="", prompt=text)
            # Its last token may merge with the text that follows it: left out.
            found.update(
                tuple(p.token_ids[:-1]) for p in completion_prompts(completion, tokenizer, limits)
            )
            chat = ChatCompletionRequest(
                model="",
                messages=[{"role": "system", "content": text}],
                add_generation_prompt=False,
            )
            prompt, _ = chat_request_prompt(chat, tokenizer, limits)
            found.add(tuple(prompt.token_ids))
        except errors.APIError:
            continue
    return tuple(sorted((p for p in found if p), key=len, reverse=True))


def shared_tokens(token_ids: Sequence[int] | None, prefixes: Sequence[Sequence[int]]) -> int:
    """How many leading tokens of the prompt are a shared prefix (the longest that matches)."""
    if not token_ids:
        return 0
    for prefix in prefixes:
        n = len(prefix)
        if n <= len(token_ids) and tuple(token_ids[:n]) == tuple(prefix):
            return n
    return 0
