"""Messages and tools as the model's chat template receives them.

HF chat templates take `tools=` and assistant `tool_calls` (arguments as objects). A template that
never mentions tools (SmolLM2's, for one) would silently drop them, and the model would answer as
if it had none: a vLLM user expects the model to see its tools, so for such a template the tools are
described in a system message, in the format the tool parser reads, and earlier calls are written
into their assistant messages the same way.
"""

from __future__ import annotations

import json
from typing import Any

from kvpilot.contract.errors import bad_request
from kvpilot.contract.openai import ChatCompletionRequest, ToolCall

_CALL_SHAPES = {
    "hermes": (
        "For each function call, return a JSON object with the function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    ),
    "llama3_json": (
        "To call a function, respond only with a JSON object of the form "
        '{"name": <function-name>, "parameters": <args-json-object>}; separate several calls '
        "with ';'."
    ),
    "mistral": (
        "To call functions, respond with [TOOL_CALLS] followed by a JSON list of "
        '{"name": <function-name>, "arguments": <args-json-object>} objects.'
    ),
}


def template_renders_tools(chat_template: str) -> bool:
    return "tools" in chat_template


def tools_system_prompt(tools: list[dict[str, Any]], parser_name: str) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query. The function "
        f"signatures are within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n"
        + _CALL_SHAPES[parser_name]
    )


def format_calls(calls: list[dict[str, Any]], parser_name: str) -> str:
    """Earlier calls ({"name", "arguments": object}) as the model would have written them."""
    if parser_name == "llama3_json":
        return "; ".join(
            json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
            for c in calls
        )
    if parser_name == "mistral":
        return "[TOOL_CALLS]" + json.dumps(calls, ensure_ascii=False)
    return "\n".join(
        f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls
    )


def _call_for_template(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError as exc:
        raise bad_request(
            f"messages: tool call {call.id!r} has arguments that are not JSON: {exc}",
            param="messages",
        ) from None
    return {"name": call.function.name, "arguments": arguments}


def template_inputs(
    request: ChatCompletionRequest, chat_template: str, parser_name: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template; `developer` is OpenAI's new name for system."""
    renders = template_renders_tools(chat_template)
    messages: list[dict[str, Any]] = []
    for m in request.messages:
        message: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": m.text(),
        }
        if m.tool_calls:
            calls = [_call_for_template(c) for c in m.tool_calls]
            if renders:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": call}
                    for c, call in zip(m.tool_calls, calls, strict=True)
                ]
            else:
                text = format_calls(calls, parser_name)
                message["content"] = f"{message['content']}\n{text}" if message["content"] else text
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None and m.role == "tool":
            message["name"] = m.name
        messages.append(message)
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    if tools is None or renders:
        return messages, tools
    described = tools_system_prompt(tools, parser_name)
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{described}"}
    else:
        messages.insert(0, {"role": "system", "content": described})
    return messages, None
