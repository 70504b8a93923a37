"""The OpenAI request bodies kvpilot accepts, validated strictly: the engine serves them and the
router parses them (to choose a replica) by these same models and checks.

Strict mode on purpose: OpenAI answers `"temperature": "0.5"` or `"n": true` with a 400, and so do
we (pydantic's lax mode would coerce them). Unknown fields are ignored, as OpenAI does; known OpenAI
fields we cannot honour (suffix, ...) are a 400 rather than silently dropped.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvpilot.contract.errors import APIError, bad_request
from kvpilot.contract.limits import RequestLimits, check_json, too_deep

RequestKind = Literal["completion", "chat"]
# Where each kind of request is served, by the engine and by the router alike.
PATHS: dict[RequestKind, str] = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}

MAX_LOGPROBS = 20  # the engine returns at most 20 top logprobs per token
MAX_N = 128  # OpenAI's own limit on n
# torch.Generator.manual_seed accepts exactly this range.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
# The engine's messages carry these as 64-bit integers.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs` extra parameter (one of its members)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


def text_of(content: str | list[TextPart] | None) -> str:
    """A message's or a prediction's content as one text (its text parts joined)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


class Prediction(_Strict):
    """OpenAI's Predicted Outputs: text the answer is expected to repeat for the most part (a file
    being edited). The engine proposes from it where the server speculates."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return text_of(self.content)


class SamplingRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    user: str | None = None
    # kvpilot/vLLM extension: requests with different salts never share prefix-cache blocks.
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # kvpilot extension: the full blocks within the first N prompt tokens are cached without
    # cache_salt, shared with every salt (a platform's common system prompt); the salt applies
    # from the next block on (contract.tenancy.unsalted_blocks). Nothing without a cache_salt.
    kvpilot_shared_prefix_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    # vLLM extension: the scheduling priority, lower served first (needs the engine's
    # --scheduling-policy priority for any value but 0).
    priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] = 0
    # kvpilot extension: a better priority than this request's that the platform expects (a
    # tenant of a better class active on the model). Under the priority policy the engine
    # guards against it while this request is queued or running, as if a request of that
    # priority had just arrived (its step bound applies before the first one does); ignored
    # under fcfs and when not better than `priority`.
    kvpilot_guard_priority: Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)] | None = None
    # {"token id": bias}; the keys are checked against the vocabulary while preprocessing.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    # Output constraints (constraints.py): OpenAI's response_format (chat and, as vLLM has it,
    # completions), vLLM's structured_outputs and its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    # OpenAI's Predicted Outputs (chat; completions too, as an extension).
    prediction: Prediction | None = None
    # OpenAI fields we do not implement: accepted only at their neutral value.
    repetition_penalty: float | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


RequestT = TypeVar("RequestT", bound=SamplingRequest)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class FunctionDef(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages

    def text(self) -> str:
        return text_of(self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice asks for a call whatever the model would say (required or named)."""
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def parse_request(
    model: type[RequestT], body: bytes, max_json_depth: int = RequestLimits.max_json_depth
) -> RequestT:
    """Parse and validate a JSON body; any problem becomes a 400 naming the offending field."""
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # nested past the parser's own stack
        raise too_deep(max_json_depth) from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    check_json(data, max_json_depth)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
    check_unsupported(request)
    return request


def validation_error(exc: ValidationError) -> APIError:
    err = exc.errors(include_url=False)[0]
    # Union members add their type name to `loc` ("stop", "list[str]", 0): keep only real keys.
    loc = [str(p) for p in err["loc"] if isinstance(p, int) or not _is_type_tag(str(p))]
    param = ".".join(loc) if loc else None
    extra = f" ({len(exc.errors())} errors in all)" if len(exc.errors()) > 1 else ""
    message = f"{param}: {err['msg']}{extra}" if param else f"{err['msg']}{extra}"
    return bad_request(message, param=loc[0] if loc else None)


def _is_type_tag(part: str) -> bool:
    return (
        part in ("str", "int", "float", "bool", "TextPart")
        or "[" in part
        or part.startswith("function-")
    )


def check_unsupported(request: SamplingRequest) -> None:
    """Reject OpenAI features we do not implement instead of silently ignoring them."""
    if request.repetition_penalty not in (None, 1.0):
        raise bad_request(
            "repetition_penalty is not supported; use presence_penalty or frequency_penalty.",
            param="repetition_penalty",
        )
    if request.stream_options is not None and not request.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true.", param="stream_options"
        )
    if isinstance(request, CompletionRequest):
        if request.suffix:
            raise bad_request("suffix is not supported.", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of is not supported (it must equal n).", param="best_of")
        if request.echo and request.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported.", param="echo")
    if isinstance(request, ChatCompletionRequest):
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        if request.continue_final_message and request.add_generation_prompt:
            raise bad_request(
                "continue_final_message and add_generation_prompt cannot both be true.",
                param="continue_final_message",
            )
        if request.continue_final_message and request.messages[-1].role != "assistant":
            raise bad_request(
                "continue_final_message needs the last message to be from the assistant.",
                param="messages",
            )


def requested_max_tokens(request: SamplingRequest) -> int | None:
    if isinstance(request, ChatCompletionRequest) and request.max_completion_tokens is not None:
        return request.max_completion_tokens
    return request.max_tokens


def num_logprobs(request: SamplingRequest) -> int | None:
    """How many top logprobs the engine must return per token (None: no logprobs at all)."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    assert isinstance(request, CompletionRequest)
    return request.logprobs


def sequences_per_prompt(request: SamplingRequest) -> int:
    """Sequences the engine generates per prompt: n, or best_of where that is larger (best_of
    is accepted only equal to n today, so the two agree)."""
    best_of = request.best_of if isinstance(request, CompletionRequest) else None
    return max(request.n, best_of or 0)
