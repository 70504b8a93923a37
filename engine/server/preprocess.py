"""From a request body to a validated request and its prompts' token ids: JSON parsing, the chat
template, tokenization.

All of it runs off the event loop, so that a huge request never stalls the streams and probes the
loop serves: on a tokenizer thread of the API process (the Rust tokenizer releases the interpreter
lock while it works), or, for bodies over BIG_BODY_BYTES, in a lower-priority worker process,
since parsing a many-megabyte JSON body holds the interpreter lock for tens of milliseconds, on any
thread.

A prompt whose characters alone prove it longer than the context is refused before it is tokenized:
no token of the vocabulary covers more than `max_chars_per_token` characters of input, so a prompt
of C characters has at least C / max_chars_per_token tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpilot.contract import errors
from kvpilot.contract.limits import (
    RequestLimits,
    check_fan_out,
    check_logit_bias,
    check_max_tokens,
    check_stop,
)
from kvpilot.contract.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestKind,
    parse_request,
    requested_max_tokens,
    sequences_per_prompt,
)
from kvpilot.engine.server.constraints import request_constraint
from kvpilot.engine.server.settings import ChatOptions
from kvpilot.engine.server.tools.parsers import parser_for_template
from kvpilot.engine.server.tools.plan import ToolPlan, plan_tools
from kvpilot.engine.server.tools.prompt import template_inputs
from kvpilot.engine.structured.spec import StructuredSpec

BIG_BODY_BYTES = 1 << 20
# Where the tokenizer normalizes its input (NFC/NFKC can merge up to 3-4 characters into one),
# the character bound is loosened by this factor.
_NORMALIZER_FACTOR = 4


@dataclass(frozen=True)
class PromptLimits:
    """What preprocessing checks a request against (picklable: it travels to the worker)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_chars_per_token: int | None  # None without a tokenizer
    requests: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)
    grammar_backend: str = "xgrammar"  # the engine core's: constraints are checked with it
    # LoRA adapters a request's `model` may name besides model_name (contract/lora.py).
    adapter_names: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Prompt:
    text: str | None  # None for token-id prompts (unless decoded for echo)
    token_ids: list[int]


@dataclass(frozen=True)
class Preprocessed:
    request: CompletionRequest | ChatCompletionRequest
    prompts: list[Prompt]
    logit_bias: tuple[tuple[int, float], ...] = ()  # checked against the vocabulary
    # The output's grammar (response_format, structured_outputs, guided_*, or a forced tool call).
    constraint: StructuredSpec | None = None
    tools: ToolPlan | None = None  # chat requests
    # The prediction's tokens (OpenAI's Predicted Outputs).
    prediction: tuple[int, ...] = ()


def max_chars_per_token(tokenizer: Any) -> int:
    """An upper bound on the input characters one token can stand for."""
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The Rust tokenizer's own batch decode: half the time of transformers' (its per-token
        # Python), during the start. transformers' clean-up after it only removes characters,
        # so the bound still holds for what the tokenizer's decode gives.
        texts = backend.decode_batch(ids, skip_special_tokens=False)
    else:
        texts = tokenizer.batch_decode(ids, skip_special_tokens=False)
    # +1: SentencePiece-style decoders drop a token's leading-space marker when it stands alone.
    longest = max(len(t) for t in texts) + 1
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        longest *= _NORMALIZER_FACTOR
    return longest


def preprocess(
    kind: RequestKind, body: bytes, tokenizer: Any, limits: PromptLimits
) -> Preprocessed:
    """Parse, validate and tokenize one request; raises errors.APIError for the client's faults."""
    depth = limits.requests.max_json_depth
    if kind == "chat":
        chat = parse_request(ChatCompletionRequest, body, depth)
        bias = _check_request(chat, 1, limits)
        constraint = request_constraint(chat, limits.grammar_backend)
        prompt, tools = chat_request_prompt(chat, tokenizer, limits)
        prediction = prediction_tokens(chat, tokenizer, limits)
        return Preprocessed(chat, [prompt], bias, tools.constraint or constraint, tools, prediction)
    request = parse_request(CompletionRequest, body, depth)
    bias = _check_request(request, len(prompt_items(request)), limits)
    constraint = request_constraint(request, limits.grammar_backend)
    prompts = completion_prompts(request, tokenizer, limits)
    prediction = prediction_tokens(request, tokenizer, limits)
    return Preprocessed(request, prompts, bias, constraint, prediction=prediction)


def prediction_tokens(
    request: CompletionRequest | ChatCompletionRequest, tokenizer: Any, limits: PromptLimits
) -> tuple[int, ...]:
    """The tokens of the request's prediction, without special tokens (empty: none given)."""
    if request.prediction is None:
        return ()
    text = request.prediction.text()
    if not text:
        return ()
    if tokenizer is None:
        raise errors.bad_request(
            "This model has no tokenizer: a prediction needs one.", param="prediction"
        )
    _check_not_surely_too_long(text, limits, what="prediction", param="prediction")
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if len(token_ids) > limits.max_model_len:  # longer than any output can be
        raise errors.context_length_exceeded(
            limits.max_model_len,
            f"your prediction has {len(token_ids)} tokens. Please reduce the length of the "
            "prediction.",
            param="prediction",
        )
    return tuple(token_ids)


def prompt_items(request: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: one text, one token-id list, or a batch of either."""
    raw = request.prompt
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(x, int) for x in raw):
        return [raw]  # type: ignore[list-item]
    return list(raw)  # type: ignore[arg-type]


def _check_request(
    request: CompletionRequest | ChatCompletionRequest, prompts: int, limits: PromptLimits
) -> tuple[tuple[int, float], ...]:
    """Before any tokenizing: the model asked for and the request's own limits. Returns the
    logit_bias as (token id, bias) pairs."""
    _check_model(request.model, limits)
    check_stop(request.stop, limits.requests)
    check_fan_out(prompts, sequences_per_prompt(request), limits.requests)
    check_max_tokens(requested_max_tokens(request), limits.requests)
    return check_logit_bias(request.logit_bias, limits.vocab_size, limits.requests)


def _check_model(requested: str | None, limits: PromptLimits) -> None:
    if (
        requested is not None
        and requested != limits.model_name
        and requested not in limits.adapter_names
    ):
        raise errors.model_not_found(requested, limits.model_name)


def completion_prompts(
    request: CompletionRequest, tokenizer: Any, limits: PromptLimits
) -> list[Prompt]:
    items = prompt_items(request)
    if not items:
        raise errors.bad_request("prompt must not be empty.", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if tokenizer is None:
                raise errors.bad_request(
                    "This model has no tokenizer: pass token ids.", param="prompt"
                )
            if not item:
                raise errors.bad_request("prompt must not be an empty string.", param="prompt")
            _check_not_surely_too_long(item, limits, what="prompt", param="prompt")
            prompts.append(Prompt(item, list(tokenizer.encode(item))))
            continue
        if not item:
            raise errors.bad_request("a token-id prompt must not be empty.", param="prompt")
        bad = [t for t in item if not 0 <= t < limits.vocab_size]
        if bad:
            raise errors.bad_request(
                f"prompt token ids must be in [0, {limits.vocab_size}); got {bad[0]}.",
                param="prompt",
            )
        text = tokenizer.decode(item) if request.echo and tokenizer is not None else None
        prompts.append(Prompt(text, list(item)))
    return prompts


def _chat_template(tokenizer: Any, chat: ChatOptions) -> str | None:
    if chat.chat_template is not None:
        return chat.chat_template
    template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
    return template if isinstance(template, str) else None


def chat_request_prompt(
    chat: ChatCompletionRequest, tokenizer: Any, limits: PromptLimits
) -> tuple[Prompt, ToolPlan]:
    """The chat request's prompt as the server renders it (template, tools) and its tool plan;
    the router hashes the same tokens."""
    template = _chat_template(tokenizer, limits.chat)
    tools = plan_tools(
        chat, limits.chat.tool_call_parser or parser_for_template(template), limits.grammar_backend
    )
    return chat_prompt(chat, tokenizer, limits, template, tools.parser_name), tools


def chat_prompt(
    request: ChatCompletionRequest,
    tokenizer: Any,
    limits: PromptLimits,
    template: str | None,
    tool_format: str,
) -> Prompt:
    if tokenizer is None or not template:
        raise errors.bad_request(
            "This model has no chat template; use /v1/completions.", param="messages"
        )
    messages, tools = template_inputs(request, template, tool_format)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=False,
        )
    except Exception as exc:  # template errors (role order, raise_exception) are the client's
        raise errors.bad_request(
            f"The chat template rejected the messages: {exc}", param="messages"
        ) from None
    _check_not_surely_too_long(text, limits, what="messages", param="messages")
    # The template already holds the special tokens: do not add a BOS twice.
    return Prompt(text, list(tokenizer.encode(text, add_special_tokens=False)))


def _check_not_surely_too_long(text: str, limits: PromptLimits, *, what: str, param: str) -> None:
    if limits.max_chars_per_token is None:
        return
    at_least = math.ceil(len(text) / limits.max_chars_per_token)
    if at_least >= limits.max_model_len:
        raise errors.context_length_exceeded(
            limits.max_model_len,
            f"your {what} has {len(text)} characters, which is at least {at_least} tokens. Please "
            f"reduce the length of the {what}.",
            param=param,
        )


def lower_priority() -> None:
    """Make the calling thread yield the CPU to the step loop and the streams (Linux: per-thread
    niceness; elsewhere the whole process's). Only for the big-body worker: a request's ordinary
    tokenization must not wait behind the engine core's threads."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


# ---- the worker process for big bodies --------------------------------------------------------

_worker: dict[str, Any] = {}


def init_worker(hf_dir: str | None, limits: PromptLimits, parent_pid: int) -> None:
    """ProcessPoolExecutor initializer: load the tokenizer once."""
    # Imported here: the router reuses this module's preprocessing and must not pay for torch.
    from kvpilot.engine.parent_death import die_with_parent

    # The pool's queues hold both ends of their pipes, so a killed server would leave this
    # process waiting forever: the kernel ends it with its parent instead.
    die_with_parent(parent_pid)
    lower_priority()
    from kvpilot.engine.model.files import load_tokenizer, set_offline_defaults, torch_kept_out

    set_offline_defaults()
    with torch_kept_out():
        _worker["tokenizer"] = None if hf_dir is None else load_tokenizer(Path(hf_dir))
    _worker["limits"] = limits


def preprocess_in_worker(
    kind: RequestKind, body: bytes, adapter_names: frozenset[str] = frozenset()
) -> Preprocessed:
    """adapter_names: the adapters as of this request (they change after the worker starts)."""
    limits = replace(_worker["limits"], adapter_names=adapter_names)
    return preprocess(kind, body, _worker["tokenizer"], limits)
