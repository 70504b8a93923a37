"""OpenAI-shaped error responses for a FastAPI app: the one JSON body, status code and headers an
APIError becomes, and the exception handlers that turn every failure into one.

Both of kvpilot's HTTP servers (the engine's API and the router) install these, so a client sees
the same error, whichever of them answered.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from kvpilot.contract.errors import APIError, bad_request

# What a server does with an APIError before it is sent (count it, log it).
ErrorObserver = Callable[[Request, APIError], None]
# The 500 an unexpected exception becomes (the server logs it and names what it may).
UnexpectedError = Callable[[Request, Exception], APIError]


def error_response(error: APIError) -> JSONResponse:
    """The response an APIError is: its body, its status code and its headers."""
    return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)


def http_error(exc: StarletteHTTPException) -> APIError:
    """Starlette's own errors (no such route, a method not allowed) in the OpenAI shape."""
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), type=kind)


def install_error_handlers(
    app: FastAPI, *, unexpected: UnexpectedError, observe: ErrorObserver | None = None
) -> None:
    """Every error `app` answers becomes an OpenAI error body: an APIError as raised (after
    `observe` saw it), Starlette's and FastAPI's own errors as 4xx, anything else the 500
    `unexpected` makes of it (that handler runs outside every middleware)."""

    async def api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        if observe is not None:
            observe(request, exc)
        return error_response(exc)

    async def starlette_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return error_response(http_error(exc))

    async def validation_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return error_response(bad_request(str(exc.errors()[0]["msg"])))

    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(unexpected(request, exc))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, starlette_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected_error)
