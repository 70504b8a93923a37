"""Grammar backends by name: the spec in a backend's own form, and a backend for a tokenizer."""

from __future__ import annotations

from typing import Any

from kvpilot.engine.structured import llguidance_backend, xgrammar_backend
from kvpilot.engine.structured.backend import DEFAULT_BACKEND, GrammarBackend, resolve_backend
from kvpilot.engine.structured.spec import StructuredSpec


def to_grammar(spec: StructuredSpec, backend: str = DEFAULT_BACKEND) -> Any:
    """The spec in the backend's own (uncompiled) form; GrammarError for a bad or unsupported
    spec. Needs no tokenizer, so the API process checks requests with it before the core."""
    if resolve_backend(backend) == "llguidance":
        return llguidance_backend.to_grammar(spec)
    return xgrammar_backend.to_grammar(spec)


def create_backend(
    name: str, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...]
) -> GrammarBackend:
    if resolve_backend(name) == "llguidance":
        return llguidance_backend.LLGuidanceBackend(tokenizer, vocab_size, stop_token_ids)
    return xgrammar_backend.XGrammarBackend(tokenizer, vocab_size, stop_token_ids)
