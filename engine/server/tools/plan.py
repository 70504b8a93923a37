"""What a request's `tools` / `tool_choice` / `parallel_tool_calls` mean for its generation: which
parser reads the output, and, when a call is forced, the grammar that makes the output a call.

- `none` (or no tools): no parsing; the tools are still shown to the model, as vLLM does.
- `auto`: free text, read by the model's tool parser (from its chat template, or the server's
  --tool-call-parser).
- `required`: the output is constrained to a JSON list of `{"name", "parameters"}` objects, one per
  call (at most one without parallel_tool_calls), each valid under its function's schema.
- a named function: the output is constrained to that function's arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from kvpilot.contract.errors import bad_request
from kvpilot.contract.openai import ChatCompletionRequest, NamedToolChoice, Tool
from kvpilot.engine.server.constraints import checked
from kvpilot.engine.server.tools.parsers import (
    NamedParser,
    RequiredParser,
    ToolParser,
    parser_named,
)
from kvpilot.engine.structured.backend import DEFAULT_BACKEND
from kvpilot.engine.structured.spec import StructuredSpec

ToolMode = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    parser_name: str  # the model's format (auto; and how tools are described to the model)
    function_name: str | None = None  # named
    parallel: bool = True
    constraint: StructuredSpec | None = None

    def parser(self) -> ToolParser | None:
        if self.mode == "none":
            return None
        if self.mode == "named":
            assert self.function_name is not None
            return NamedParser(self.function_name)
        if self.mode == "required":
            return RequiredParser()
        return parser_named(self.parser_name)


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else ANY_OBJECT


def plan_tools(
    request: ChatCompletionRequest, parser_name: str, backend: str = DEFAULT_BACKEND
) -> ToolPlan:
    """The plan for this request; a 400 naming tools or tool_choice for what cannot be done."""
    tools = request.tools or []
    choice = request.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return ToolPlan("none", parser_name)
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request("tools: function names must be unique.", param="tools")
    for tool in tools:  # every schema is checked, whichever may be called
        checked(StructuredSpec.json_schema(parameters_schema(tool)), "tools", backend)
    if choice == "none":
        return ToolPlan("none", parser_name)
    if isinstance(choice, NamedToolChoice):
        by_name = {t.function.name: t for t in tools}
        tool = by_name.get(choice.function.name)
        if tool is None:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not in tools.",
                param="tool_choice",
            )
        spec = StructuredSpec.json_schema(parameters_schema(tool))
        return ToolPlan("named", parser_name, tool.function.name, constraint=spec)
    if choice == "required":
        spec = checked(
            StructuredSpec.json_schema(required_schema(tools, request.parallel_tool_calls)),
            "tools",
            backend,
        )
        return ToolPlan(
            "required", parser_name, parallel=request.parallel_tool_calls, constraint=spec
        )
    return ToolPlan("auto", parser_name, parallel=request.parallel_tool_calls)


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """A JSON list of calls, each one of the tools with arguments valid under its schema."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t.function.name]},
                "parameters": parameters_schema(t),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
