"""The grammar backend contract and its xgrammar implementation.

xgrammar was picked by measurement (bench/grammar_backends.py, bench/RESULTS.md "issue 16"): on the
SmolLM2 tokenizer it compiles a small schema in milliseconds and fills a 49152-token mask in a few
microseconds, and takes JSON schemas, regular expressions and EBNF. Everything xgrammar-specific
stays in this module; the engine sees only `GrammarBackend` and `GrammarMatcher`.

JSON is generated compact (no free whitespace between tokens): a small model left free to emit
whitespace can spend its whole max_tokens on newlines, and compact output is fewer tokens.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Protocol

import torch

from kvpilot.engine.structured.spec import StructuredSpec


class GrammarError(ValueError):
    """The spec is not valid, or uses something the backend does not support."""


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None: ...

    def accept(self, token_id: int) -> bool: ...

    @property
    def is_terminated(self) -> bool: ...


class GrammarBackend(Protocol):
    name: str

    def compile(self, grammar: Any) -> Any: ...

    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor: ...


def _ebnf_literal(text: str) -> str:
    # JSON string escapes (\" \\ \n \uXXXX) are ones xgrammar's EBNF string literals read too.
    return json.dumps(text)


def to_grammar(spec: StructuredSpec) -> Any:
    """The spec as an (uncompiled) xgrammar Grammar; GrammarError for a bad or unsupported spec.
    Needs no tokenizer, so the API process checks requests with it before they reach the core."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            schema = json.loads(spec.value)
            check_json_schema(schema)
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


def check_json_schema(schema: object) -> None:
    """GrammarError unless schema is a valid JSON Schema (xgrammar skips keywords it does not
    know, so a misspelt type would otherwise pass silently as 'anything')."""
    import jsonschema

    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"invalid JSON schema: {exc.message}") from None


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

    @property
    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarBackend:
    """Compiles grammars for one tokenizer; compiled grammars are kept in an LRU cache by spec.
    Thread-safe: the engine core compiles on one thread and fills masks on another."""

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
        # Our cache below is keyed by spec; xgrammar's own would hold a second copy.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.num_compiles = 0

    def compile_spec(self, spec: StructuredSpec, grammar: Any | None = None) -> Any:
        """The compiled grammar of spec, from the cache when it was compiled before."""
        with self._lock:
            if spec.key in self._cache:
                self._cache.move_to_end(spec.key)
                return self._cache[spec.key]
        compiled = self.compile(grammar if grammar is not None else to_grammar(spec))
        with self._lock:
            self.num_compiles += 1
            self._cache[spec.key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def compile(self, grammar: Any) -> Any:
        return self._compiler.compile_grammar(grammar)

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return _XGrammarMatcher(self._xgr.GrammarMatcher(compiled))

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(num_rows, self.vocab_size)
