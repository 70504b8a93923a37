"""A request as the router needs it: the model it names, and its prompt's chained block hashes,
computed with the engine's own parsing, chat template and tokenizer (kvpilot.engine.server
.preprocess), so the hashes are the ones the engine's prefix cache will hold."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpilot.contract import errors
from kvpilot.contract.block_hash import chain_block_hashes
from kvpilot.contract.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestKind,
    parse_request,
)
from kvpilot.engine.server.preprocess import PromptLimits, chat_request_prompt, completion_prompts

# The engine checks token ids against its vocabulary and prompts against its context; the router
# does not know either and leaves those answers to the engine.
_ANY_VOCAB = 1 << 31
_ANY_LENGTH = 1 << 31


@dataclass(frozen=True)
class ParsedRequest:
    request: CompletionRequest | ChatCompletionRequest

    @property
    def model(self) -> str | None:
        return self.request.model


def parse(kind: RequestKind, body: bytes) -> ParsedRequest:
    """errors.APIError (400) for a body no engine could accept either."""
    model = ChatCompletionRequest if kind == "chat" else CompletionRequest
    return ParsedRequest(parse_request(model, body))


def prompt_token_ids(parsed: ParsedRequest, tokenizer: Any) -> list[int] | None:
    """The first prompt's token ids as the engine will see them; None when the router cannot
    tell (no tokenizer, or a request the engine will refuse: it answers that itself)."""
    limits = PromptLimits("", _ANY_LENGTH, _ANY_VOCAB, None)
    try:
        if isinstance(parsed.request, ChatCompletionRequest):
            if tokenizer is None:
                return None
            return chat_request_prompt(parsed.request, tokenizer, limits)[0].token_ids
        prompts = completion_prompts(parsed.request, tokenizer, limits)
    except errors.APIError:
        return None
    return prompts[0].token_ids if prompts else None


def block_chain(
    token_ids: list[int] | None,
    block_size: int | None,
    salt: str | None,
    lora_name: str | None = None,
    *,
    unsalted_blocks: int = 0,
) -> list[int]:
    """The hashes of the blocks the engine could reuse: never the one holding the last token.
    lora_name: the adapter the request names (None: the base model); its blocks are the
    adapter's own, shared with no other adapter and not with the base model. unsalted_blocks:
    leading blocks hashed without the salt (a prefix shared across tenants)."""
    if not token_ids or not block_size:
        return []
    return chain_block_hashes(
        token_ids[:-1], block_size, salt, lora_name=lora_name, unsalted_blocks=unsalted_blocks
    )
