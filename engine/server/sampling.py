"""A validated OpenAI request as the engine's SamplingParams."""

from __future__ import annotations

from kvpilot.contract.errors import bad_request
from kvpilot.contract.openai import SamplingRequest, num_logprobs
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured.spec import StructuredSpec


def to_sampling_params(
    request: SamplingRequest,
    max_tokens: int,
    logit_bias: tuple[tuple[int, float], ...] = (),
    structured: StructuredSpec | None = None,
    prediction: tuple[int, ...] = (),
) -> SamplingParams:
    """Map validated request fields onto SamplingParams (OpenAI defaults for absent fields)."""
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    try:
        return SamplingParams(
            n=request.n,
            max_tokens=max_tokens,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if request.top_k is None else request.top_k,
            min_p=0.0 if request.min_p is None else request.min_p,
            seed=request.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=num_logprobs(request),
            presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
            logit_bias=logit_bias,
            structured=structured,
            prediction_token_ids=prediction,
        )
    except ValueError as exc:
        # SamplingParams names the field first in its message.
        message = str(exc)
        raise bad_request(message, param=message.split(" ", 1)[0]) from None
