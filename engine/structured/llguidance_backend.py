"""llguidance behind the GrammarBackend contract. Its grammars are Lark text, compiled lazily by
the matcher itself (about a millisecond, bench/grammar_backends.py), so the cache holds the
checked grammar text."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from kvpilot.engine.structured.backend import (
    CachedCompiles,
    GrammarCache,
    GrammarError,
    GrammarMatcher,
    check_json_schema,
)
from kvpilot.engine.structured.spec import StructuredSpec

# Compact JSON, as the xgrammar backend writes it.
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def to_grammar(spec: StructuredSpec) -> str:
    """The spec as llguidance grammar text; GrammarError for a bad or unsupported spec."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        if spec.kind == "json":
            schema = json.loads(spec.value)
            check_json_schema(schema)
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        elif spec.kind == "json_object":
            grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        elif spec.kind == "regex":
            grammar = LLMatcher.grammar_from_regex(spec.value)
        elif spec.kind == "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            grammar = LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        else:
            grammar = LLMatcher.grammar_from_lark(gbnf_to_lark(spec.value))
    except GrammarError:
        raise
    except Exception as exc:  # the converters raise their own error types
        raise GrammarError(str(exc)) from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(error.strip())
    return grammar


class _LLGuidanceMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.consume_token(token_id))

    def num_acceptable(self, token_ids: list[int]) -> int:
        # A refused token would put the matcher in its error state: validate first, then walk
        # only the valid ones to find where the grammar ends.
        valid = int(self._matcher.validate_tokens(token_ids))
        count = 0
        for token in token_ids[:valid]:
            self._matcher.consume_token(token)
            if self._matcher.is_stopped():
                self._matcher.rollback(1)
                break
            count += 1
        if count:
            self._matcher.rollback(count)
        return count

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())


class LLGuidanceBackend(CachedCompiles):
    name = "llguidance"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_size: int = 128,
    ) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids)
        )
        self._cache = GrammarCache(lambda grammar: grammar, cache_size)

    def _to_grammar(self, spec: StructuredSpec) -> Any:
        return to_grammar(spec)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        from llguidance import LLMatcher

        matcher = LLMatcher(self._tokenizer, compiled)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return _LLGuidanceMatcher(matcher)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import torch

        words = (self.vocab_size + 31) // 32
        return torch.full((num_rows, words), -1, dtype=torch.int32)
