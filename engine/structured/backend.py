"""The grammar backend contract, what every backend shares (the compiled-grammar cache, the JSON
Schema check), and the registry of backends.

Two backends sit behind it (registry.py picks one by name): xgrammar (the default, picked by
measurement: bench/grammar_backends.py and bench/RESULTS.md "Structured outputs") and
llguidance. Everything library-specific stays in its own module; the engine sees only
`GrammarBackend` and `GrammarMatcher`.

JSON is generated compact (no free whitespace between tokens): a small model left free to emit
whitespace can spend its whole max_tokens on newlines, and compact output is fewer tokens.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

from kvpilot.engine.structured.spec import StructuredSpec

BACKEND_NAMES = ("xgrammar", "llguidance")
DEFAULT_BACKEND = "xgrammar"


class GrammarError(ValueError):
    """The spec is not valid, or uses something the backend does not support."""


class GrammarMatcher(Protocol):
    """One sequence's position in its grammar."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into bitmask[row] (bit t % 32 of word t // 32)."""
        ...

    def accept(self, token_id: int) -> bool: ...

    def num_acceptable(self, token_ids: list[int]) -> int:
        """How many leading tokens of token_ids the grammar takes in turn from here without
        reaching its end: the count stops before a token it refuses and before one after which
        it is terminated. The matcher's state is left as it was."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""
        ...

    @property
    def is_terminated(self) -> bool:
        """Nothing but the end can follow (a stop token was accepted, or only one is allowed)."""
        ...


class GrammarBackend(Protocol):
    name: str
    vocab_size: int
    num_compiles: int

    def compile_spec(self, spec: StructuredSpec, grammar: Any | None = None) -> Any: ...

    def matcher(self, compiled: Any) -> GrammarMatcher: ...

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor: ...


def resolve_backend(name: str) -> str:
    """ "auto" -> the default; GrammarError for a name we do not have."""
    if name == "auto":
        return DEFAULT_BACKEND
    if name not in BACKEND_NAMES:
        raise GrammarError(f"the grammar backend must be auto or one of {BACKEND_NAMES}")
    return name


def check_json_schema(schema: object) -> None:
    """GrammarError unless schema is a valid JSON Schema (grammar libraries skip keywords they do
    not know, so a misspelt type would otherwise pass silently as 'anything')."""
    import jsonschema

    if not isinstance(schema, dict):
        raise GrammarError("a JSON schema must be a JSON object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        raise GrammarError(f"invalid JSON schema: {exc.message}") from None


class GrammarCache:
    """Compiled grammars by spec, least recently used first out; thread-safe (the core compiles on
    one thread and reads matchers on others)."""

    def __init__(self, compile_grammar: Callable[[Any], Any], size: int = 128) -> None:
        self._compile = compile_grammar
        self._entries: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()
        self.num_compiles = 0

    def get(self, spec: StructuredSpec, grammar: Any) -> Any:
        with self._lock:
            if spec.key in self._entries:
                self._entries.move_to_end(spec.key)
                return self._entries[spec.key]
        compiled = self._compile(grammar)
        with self._lock:
            self.num_compiles += 1
            self._entries[spec.key] = compiled
            while len(self._entries) > self._size:
                self._entries.popitem(last=False)
        return compiled


class CachedCompiles:
    """`compile_spec` and `num_compiles` over a GrammarCache, for a backend that sets `_cache` and
    converts specs in `_to_grammar`."""

    _cache: GrammarCache

    def _to_grammar(self, spec: StructuredSpec) -> Any:
        raise NotImplementedError

    @property
    def num_compiles(self) -> int:
        return self._cache.num_compiles

    def compile_spec(self, spec: StructuredSpec, grammar: Any | None = None) -> Any:
        """The compiled grammar of spec, from the cache when it was compiled before."""
        return self._cache.get(spec, grammar if grammar is not None else self._to_grammar(spec))
