"""OpenAI-style errors: one exception type the routes raise, one JSON body every error response has.

OpenAI clients (the official SDK, LangChain, curl scripts) branch on the status code and read
`{"error": {"message", "type", "param", "code"}}`; we keep both in that shape, whatever failed.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Picklable (keyword-only fields): preprocessing raises these in a worker process too.
        return (
            _rebuild,
            (self.status_code, self.message, self.type, self.param, self.code, self.headers),
        )

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)


def _rebuild(
    status_code: int,
    message: str,
    type: str,
    param: str | None,
    code: str | None,
    headers: dict[str, str],
) -> APIError:
    return APIError(status_code, message, type=type, param=param, code=code, headers=headers)


def error_body(
    message: str, *, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, type="invalid_request_error", param=param, code=code)


def context_length_exceeded(max_model_len: int, however: str, *, param: str) -> APIError:
    """OpenAI's 400 for a request past the model's context: its sentence, then `however` (what
    the request holds, and what to reduce)."""
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, {however}",
        param=param,
        code="context_length_exceeded",
    )


def too_large(num_bytes: int | None, limit: int) -> APIError:
    what = "exceeds" if num_bytes is None else f"has {num_bytes} bytes, over"
    return APIError(
        413,
        f"The request body {what} the limit of {limit} bytes.",
        type="invalid_request_error",
        code="request_too_large",
    )


def unauthorized() -> APIError:
    return APIError(
        401,
        "Incorrect or missing API key: pass it as `Authorization: Bearer <key>`.",
        type="invalid_request_error",
        code="invalid_api_key",
    )


def model_does_not_exist(requested: str, hint: str) -> APIError:
    """OpenAI's answer for an unknown model (404 invalid_request_error, model_not_found), from
    the engine and the router alike; `hint` says where the served models are."""
    return APIError(
        404,
        f"The model `{requested}` does not exist. {hint}",
        type="invalid_request_error",
        param="model",
        code="model_not_found",
    )


def model_not_found(requested: str, served: str) -> APIError:
    return model_does_not_exist(requested, f"This server serves `{served}`.")


def queue_full(num_waiting: int, max_queue: int, retry_after_s: int) -> APIError:
    return APIError(
        429,
        f"The server's queue is full ({num_waiting} requests waiting, --max-queue {max_queue}); "
        f"retry after {retry_after_s} s.",
        type="rate_limit_error",
        code="queue_full",
        headers={"Retry-After": str(retry_after_s)},
    )


def unavailable(message: str, *, code: str) -> APIError:
    return APIError(503, message, type="service_unavailable", code=code)


def internal_error(message: str) -> APIError:
    return APIError(500, message, type="internal_error", code="internal_error")
