"""xgrammar behind the GrammarBackend contract (the default backend)."""

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


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are ones xgrammar's EBNF string literals read too.
    return json.dumps(text)


def to_grammar(spec: StructuredSpec) -> Any:
    """The spec as an xgrammar Grammar; GrammarError for a bad or unsupported spec."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            check_json_schema(json.loads(spec.value))
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            choices = json.loads(spec.value)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(map(_ebnf_literal, choices)))
        return xgr.Grammar.from_ebnf(spec.value)
    except GrammarError:
        raise
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(_clean_message(str(exc))) from None


def _clean_message(message: str) -> str:
    # xgrammar prefixes "[hh:mm:ss] /path/file.cc:123: "; the client needs only the reason.
    _, sep, tail = message.partition(".cc:")
    if sep:
        return tail.split(": ", 1)[-1].strip()
    return message.strip()


class _XGrammarMatcher:
    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(token_id))

    def num_acceptable(self, token_ids: list[int]) -> int:
        # A refused token leaves an xgrammar matcher as it was, so trying is checking.
        count = 0
        for token in token_ids:
            if not self._matcher.accept_token(token):
                break
            if self._matcher.is_terminated():
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
        return bool(self._matcher.is_terminated())


class XGrammarBackend(CachedCompiles):
    """Compiles grammars for one tokenizer, cached by spec."""

    name = "xgrammar"

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        cache_size: int = 128,
    ) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        # Our cache is keyed by spec; xgrammar's own would hold a second copy.
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache = GrammarCache(compiler.compile_grammar, cache_size)

    def _to_grammar(self, spec: StructuredSpec) -> Any:
        return to_grammar(spec)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
