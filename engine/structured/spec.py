"""What a request constrains its output to, as it crosses from the API process to the engine core:
plain data, no compiled grammar (the core compiles, and caches by spec)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

SpecKind = Literal["json", "json_object", "regex", "choice", "grammar"]
SPEC_KINDS: tuple[SpecKind, ...] = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredSpec:
    """kind "json": value is a JSON schema (as JSON text); "json_object": any JSON object (value
    empty); "regex": a regular expression; "choice": a JSON list of the allowed strings;
    "grammar": an EBNF grammar (GBNF-style, as vLLM's guided_grammar takes)."""

    kind: SpecKind
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in SPEC_KINDS:
            raise ValueError(
                f"structured output kind must be one of {SPEC_KINDS}, got {self.kind!r}"
            )

    @property
    def key(self) -> tuple[str, str]:
        """What compiled grammars are cached by."""
        return (self.kind, self.value)

    @classmethod
    def json_schema(cls, schema: dict[str, object]) -> StructuredSpec:
        # Key order is kept: it is the order the generated object's fields come in.
        return cls("json", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredSpec:
        return cls("choice", json.dumps(choices))
