"""/v1/completions and /v1/chat/completions: from a validated request to engine requests and back.

One HTTP request becomes one engine request per prompt (completions accept a batch of prompts);
the engine itself expands `n`. Choice index = prompt index * n + the engine's output index, as
OpenAI does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpilot.contract import errors
from kvpilot.contract.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    num_logprobs,
    requested_max_tokens,
)
from kvpilot.engine.outputs import OutputKind, RequestOutput
from kvpilot.engine.server import render
from kvpilot.engine.server.async_engine import (
    EngineDeadError,
    RequestCut,
    RequestFailed,
    RequestStream,
)
from kvpilot.engine.server.preprocess import Preprocessed, Prompt
from kvpilot.engine.server.sampling import to_sampling_params
from kvpilot.engine.server.sse import ClientGone, SSEResponse, unless_disconnected
from kvpilot.engine.server.state import InFlight, ServerState
from kvpilot.engine.server.tools import render as tool_render
from kvpilot.engine.server.tools.parsers import ToolParser
from kvpilot.engine.server.tools.plan import ToolPlan
from kvpilot.engine.structured.spec import StructuredSpec


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    *,
    what: str,
    param: str,
    limit: int | None = None,
) -> int:
    """max_tokens to use, or a 400 with OpenAI's context-length message and the numbers. Without
    a request's own max_tokens: what the context leaves, at most `limit` (the server's cap)."""
    if prompt_len >= max_model_len:
        raise errors.context_length_exceeded(
            max_model_len,
            f"your {what} has {prompt_len} tokens, which leaves no room for a completion. Please "
            f"reduce the length of the {what}.",
            param=param,
        )
    if requested is None:
        return min(max_model_len - prompt_len, limit or max_model_len)
    if prompt_len + requested > max_model_len:
        raise errors.context_length_exceeded(
            max_model_len,
            f"you requested {prompt_len + requested} tokens ({prompt_len} in the {what}, "
            f"{requested} in the completion). Please reduce the length of the {what} or "
            "completion.",
            param="max_tokens",
        )
    return requested


def failure_error(exc: RequestFailed) -> errors.APIError:
    if isinstance(exc, RequestCut):
        return errors.unavailable(f"The request was cut short: {exc}", code="shutdown")
    return errors.internal_error(str(exc))


class Generation:
    """The engine requests behind one HTTP request; close() aborts any unfinished one."""

    def __init__(self, streams: list[RequestStream], ticket: InFlight) -> None:
        self.streams = streams
        self._ticket = ticket
        ticket.on_cut = self.cut

    def close(self) -> None:
        for stream in self.streams:
            stream.abort()
        self._ticket.release()

    def cut(self) -> None:
        reason = RequestCut("the server is shutting down and its drain timeout ran out")
        for stream in self.streams:
            stream.cut(reason)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, the stream's next output: a DELTA) until every stream has finished."""
        if len(self.streams) == 1:
            stream = self.streams[0]
            while True:
                output = await stream.next_output()
                yield 0, output
                if output.finished:
                    return
        pending = {asyncio.ensure_future(s.next_output()): i for i, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: pending[t]):
                    index = pending.pop(task)
                    output = task.result()
                    yield index, output
                    if not output.finished:
                        pending[asyncio.ensure_future(self.streams[index].next_output())] = index
        finally:
            for task in pending:
                task.cancel()

    async def final_outputs(self) -> list[RequestOutput]:
        return list(await asyncio.gather(*(s.final_output() for s in self.streams)))


def usage_of(
    prompts: list[Prompt],
    outputs: list[RequestOutput | None],
    cursors: Iterable[render.ChoiceCursor] | None = None,
) -> dict[str, Any]:
    """Usage from whole outputs, or from a stream's cursors (its outputs are deltas)."""
    if cursors is None:
        completion_tokens = sum(
            len(o.token_ids) for out in outputs if out is not None for o in out.outputs
        )
    else:
        completion_tokens = sum(cursor.num_tokens for cursor in cursors)
    return render.usage(
        prompt_tokens=sum(len(p.token_ids) for p in prompts),
        completion_tokens=completion_tokens,
        cached_tokens=sum(out.num_cached_tokens for out in outputs if out is not None),
        draft_tokens=sum(out.num_draft_tokens for out in outputs if out is not None),
        accepted_tokens=sum(out.num_accepted_tokens for out in outputs if out is not None),
    )


async def start_generation(
    state: ServerState,
    request: CompletionRequest | ChatCompletionRequest,
    prompts: list[Prompt],
    request_id: str,
    arrival_time: float,
    logit_bias: tuple[tuple[int, float], ...] = (),
    constraint: StructuredSpec | None = None,
    prediction: tuple[int, ...] = (),
) -> Generation:
    """The request's prompts added to the engine, with the LoRA adapter its `model` names."""
    info = state.engine.info
    assert info is not None
    if request.priority != 0 and info.scheduling_policy != "priority":
        raise errors.bad_request(
            f"Got priority {request.priority} but Priority scheduling is not enabled.",
            param="priority",
        )
    is_chat = isinstance(request, ChatCompletionRequest)
    what, param = ("messages", "messages") if is_chat else ("prompt", "prompt")
    params = [
        to_sampling_params(
            request,
            resolve_max_tokens(
                requested_max_tokens(request),
                len(p.token_ids),
                info.max_model_len,
                what=what,
                param=param,
                limit=state.settings.limits.max_tokens,
            ),
            logit_bias,
            constraint,
            prediction,
        )
        for p in prompts
    ]
    state.check_queue()
    ticket = state.admit()
    streams: list[RequestStream] = []
    try:
        for i, (prompt, sampling) in enumerate(zip(prompts, params, strict=True)):
            rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(
                await state.engine.add_request(
                    rid,
                    prompt.token_ids,
                    sampling,
                    prompt_text=prompt.text,
                    cache_salt=request.cache_salt,
                    arrival_time=arrival_time,
                    kind=OutputKind.DELTA if request.stream else OutputKind.FINAL_ONLY,
                    lora_name=adapter_of(state, request.model),
                    priority=request.priority,
                    shared_prefix_tokens=(
                        request.kvpilot_shared_prefix_tokens if request.cache_salt else 0
                    ),
                    guard_priority=request.kvpilot_guard_priority,
                )
            )
    except BaseException as exc:
        for stream in streams:
            stream.abort()
        ticket.release()
        if isinstance(exc, ValueError):  # the engine's verdict on this prompt
            raise errors.bad_request(str(exc), param=param) from None
        if isinstance(exc, EngineDeadError):
            raise errors.unavailable(str(exc), code="engine_dead") from None
        raise
    return Generation(streams, ticket)


def adapter_of(state: ServerState, model: str | None) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model)."""
    info = state.engine.info
    if model is None or info is None or model == info.model_name:
        return None
    return model if model in state.engine.adapters else None


def answered_model(state: ServerState, model: str | None) -> str:
    """The `model` a response names: the adapter's name for an adapter's request, as vLLM."""
    info = state.engine.info
    assert info is not None
    return adapter_of(state, model) or info.model_name


async def create_completion(state: ServerState, http: Request) -> Response:
    arrival = time.monotonic()
    info = state.model_info()  # 503 while loading or draining, before reading anything
    pre = await state.preprocess(info, "completion", http)
    request, prompts = pre.request, pre.prompts
    assert isinstance(request, CompletionRequest)
    header = render.ResponseHeader(
        f"cmpl-{uuid.uuid4().hex}", int(time.time()), answered_model(state, request.model)
    )
    generation = await start_generation(
        state, request, prompts, header.id, arrival, pre.logit_bias, pre.constraint, pre.prediction
    )
    if request.stream:
        return SSEResponse(
            _completion_events(generation, request, prompts, header), on_close=generation.close
        )
    try:
        finals = await unless_disconnected(generation.final_outputs(), http.receive)
    except ClientGone:
        return Response(status_code=499)
    except RequestFailed as exc:
        raise failure_error(exc) from None
    finally:
        generation.close()
    num_top = request.logprobs
    choices = []
    for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        for o in final.outputs:
            logprobs = None
            if num_top is not None and o.logprobs is not None:
                logprobs, _ = render.completion_logprobs(o.token_ids, o.logprobs, num_top, 0)
            text = (prompt.text or "") + o.text if request.echo else o.text
            choices.append(render.completion_choice(i * request.n + o.index, text, logprobs, o))
    body = render.completion_body(header, choices, usage_of(prompts, list(finals)))
    return JSONResponse(body)


async def _completion_events(
    generation: Generation,
    request: CompletionRequest,
    prompts: list[Prompt],
    header: render.ResponseHeader,
) -> AsyncIterator[bytes]:
    n, num_top, with_usage = request.n, request.logprobs, request.include_usage
    cursors = {(i, k): render.ChoiceCursor() for i in range(len(prompts)) for k in range(n)}
    latest: list[RequestOutput | None] = [None] * len(prompts)

    def chunk(index: int, text: str, **fields: Any) -> bytes:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None, **fields}
        return render.sse(render.completion_chunk(header, [choice], with_usage_field=with_usage))

    if request.echo:
        for i, prompt in enumerate(prompts):
            for k in range(n):
                yield chunk(i * n + k, prompt.text or "")
    try:
        async for i, output in generation.outputs():
            latest[i] = output
            for o in output.outputs:
                cursor = cursors[(i, o.index)]
                delta = render.next_delta(cursor, o)
                if delta is None:
                    continue
                logprobs = None
                if num_top is not None and delta.logprobs is not None:
                    logprobs, cursor.text_offset = render.completion_logprobs(
                        delta.token_ids, delta.logprobs, num_top, cursor.text_offset
                    )
                fields: dict[str, Any] = {
                    "logprobs": logprobs,
                    "finish_reason": delta.finish_reason,
                }
                if delta.finish_reason is not None:
                    fields["stop_reason"] = delta.stop_reason
                yield chunk(i * n + o.index, delta.text, **fields)
    except RequestFailed as exc:
        yield render.sse(failure_error(exc).body())
        yield render.DONE
        return
    if with_usage:
        usage = usage_of(prompts, latest, cursors.values())
        yield render.sse(render.usage_chunk(header, "text_completion", usage))
    yield render.DONE


async def create_chat_completion(state: ServerState, http: Request) -> Response:
    arrival = time.monotonic()
    info = state.model_info()
    pre = await state.preprocess(info, "chat", http)
    request, prompts = pre.request, pre.prompts
    assert isinstance(request, ChatCompletionRequest)
    header = render.ResponseHeader(
        f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), answered_model(state, request.model)
    )
    generation = await start_generation(
        state, request, prompts, header.id, arrival, pre.logit_bias, pre.constraint, pre.prediction
    )
    tools = _tool_reading(pre)
    if request.stream:
        return SSEResponse(
            _chat_events(generation, request, prompts, header, tools), on_close=generation.close
        )
    try:
        (final,) = await unless_disconnected(generation.final_outputs(), http.receive)
    except ClientGone:
        return Response(status_code=499)
    except RequestFailed as exc:
        raise failure_error(exc) from None
    finally:
        generation.close()
    num_top = num_logprobs(request)
    choices = []
    for o in final.outputs:
        logprobs = None
        if num_top is not None and o.logprobs is not None:
            logprobs = render.chat_logprobs(o.token_ids, o.logprobs, num_top)
        choice = render.chat_choice(o.index, o.text, logprobs, o)
        if tools is not None:
            parsed = tool_render.parse_final(tools.parser, o.text, tools.max_calls)
            choice["message"] = tool_render.tool_message(parsed, o.text)
            choice["finish_reason"] = tool_render.finish_reason(parsed, o.finish_reason)
        choices.append(choice)
    return JSONResponse(render.chat_body(header, choices, usage_of(prompts, [final])))


class ToolReading:
    """How a chat request's outputs are read for tool calls."""

    def __init__(self, plan: ToolPlan, parser: ToolParser) -> None:
        self.parser = parser
        self.max_calls = None if plan.parallel else 1


def _tool_reading(pre: Preprocessed) -> ToolReading | None:
    if pre.tools is None:
        return None
    parser = pre.tools.parser()
    return None if parser is None else ToolReading(pre.tools, parser)


async def _chat_events(
    generation: Generation,
    request: ChatCompletionRequest,
    prompts: list[Prompt],
    header: render.ResponseHeader,
    tools: ToolReading | None = None,
) -> AsyncIterator[bytes]:
    num_top, with_usage = num_logprobs(request), request.include_usage
    cursors = [render.ChoiceCursor() for _ in range(request.n)]
    tool_cursors = [tool_render.ToolStreamCursor() for _ in range(request.n)]
    texts = [""] * request.n  # each choice's whole text, for the tool parser
    latest: list[RequestOutput | None] = [None]

    def chunk(choice: dict[str, Any]) -> bytes:
        return render.sse(render.chat_chunk(header, [choice], with_usage_field=with_usage))

    # OpenAI opens every choice with a role delta before any content.
    for k in range(request.n):
        yield chunk(render.chat_chunk_choice(k, {"role": "assistant", "content": ""}))
    try:
        async for _, output in generation.outputs():
            latest[0] = output
            for o in output.outputs:
                delta = render.next_delta(cursors[o.index], o)
                if delta is None:
                    continue
                logprobs = None
                if num_top is not None and delta.logprobs is not None and delta.token_ids:
                    logprobs = render.chat_logprobs(delta.token_ids, delta.logprobs, num_top)
                finish_reason = delta.finish_reason
                if tools is not None:
                    texts[o.index] += delta.text
                    deltas, parsed = tool_render.tool_deltas(
                        tool_cursors[o.index],
                        tools.parser,
                        texts[o.index],
                        final=finish_reason is not None,
                        max_calls=tools.max_calls,
                    )
                    for i, piece in enumerate(deltas):
                        yield chunk(
                            render.chat_chunk_choice(o.index, piece, logprobs if i == 0 else None)
                        )
                    if finish_reason is not None:
                        finish_reason = tool_render.finish_reason(parsed, finish_reason)
                elif delta.text or logprobs is not None:
                    yield chunk(
                        render.chat_chunk_choice(o.index, {"content": delta.text}, logprobs)
                    )
                if finish_reason is not None:
                    yield chunk(
                        render.chat_chunk_choice(
                            o.index, {}, None, finish_reason, delta.stop_reason
                        )
                    )
    except RequestFailed as exc:
        yield render.sse(failure_error(exc).body())
        yield render.DONE
        return
    if with_usage:
        yield render.sse(
            render.usage_chunk(header, "chat.completion.chunk", usage_of(prompts, latest, cursors))
        )
    yield render.DONE
