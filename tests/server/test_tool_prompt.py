"""How tools and earlier tool calls reach the model's prompt (preprocessing with the real SmolLM2
tokenizer): a template that renders tools gets them as `tools=`; SmolLM2's, which ignores them,
gets them described in a system message in the tool parser's format; a server-wide template and
parser override both."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvpilot.engine.model.loader import load_tokenizer, resolve_model
from kvpilot.engine.server.preprocess import ChatOptions, PromptLimits, preprocess

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
]
TOOLS_TEMPLATE = (
    "{% if tools %}TOOLS={{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% for c in m.tool_calls or [] %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model(None, "auto").hf_dir)


def _prompt(tokenizer: Any, chat: ChatOptions, **body: Any) -> str:
    limits = PromptLimits("m", 2048, len(tokenizer), None, chat=chat)
    raw = json.dumps({"messages": HISTORY, "tools": [TOOL], **body}).encode()
    pre = preprocess("chat", raw, tokenizer, limits)
    text = pre.prompts[0].text
    assert text is not None
    return text


def test_a_template_that_ignores_tools_gets_them_in_a_system_message(tokenizer: Any) -> None:
    text = _prompt(tokenizer, ChatOptions())
    assert text.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(TOOL) in text and "<tool_call></tool_call> XML tags" in text
    # The earlier call, written as the model would have written it; the tool result follows.
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>tool\n21 C<|im_end|>" in text


def test_the_parser_override_changes_the_described_format(tokenizer: Any) -> None:
    text = _prompt(tokenizer, ChatOptions(tool_call_parser="mistral"))
    assert "[TOOL_CALLS]" in text and "<tool_call>" not in text


def test_a_template_that_renders_tools_gets_them_as_tools(tokenizer: Any) -> None:
    text = _prompt(tokenizer, ChatOptions(chat_template=TOOLS_TEMPLATE))
    assert text.startswith("TOOLS=[{")
    assert json.loads(text.split("\n", 1)[0].removeprefix("TOOLS=")) == [TOOL]
    assert 'CALL get_weather {"city": "Paris"}' in text  # arguments as an object, not a string
    assert "You may call" not in text
