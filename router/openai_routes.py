"""The two routes every request takes (POST /v1/chat/completions, /v1/completions), served as bare
ASGI in front of the FastAPI app, which serves everything else (probes, models, /metrics, the
lifespan).

Why not a FastAPI or Starlette route: the router's CPU per request is its overhead, and the
layers a routed request crossed there (five middlewares, the route table's regexes, a Request
object) cost more than choosing its replica did (bench/RESULTS.md). Errors keep the engine's
OpenAI bodies: APIError as raised, anything unexpected a logged 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpilot.contract import errors
from kvpilot.contract.http_errors import error_response
from kvpilot.contract.openai import PATHS, RequestKind
from kvpilot.router.prompts import parse
from kvpilot.router.proxy import Proxy, RelayResponse

log = logging.getLogger("kvpilot.router")

ROUTES: dict[str, RequestKind] = {path: kind for kind, path in PATHS.items()}


class ClientGone(Exception):
    """The client disconnected before its body was read: there is no one to answer."""


class OpenAIRoutes:
    def __init__(self, app: ASGIApp, proxy: Proxy, max_body_bytes: int) -> None:
        self.app = app  # everything else
        self.proxy = proxy
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = ROUTES.get(scope["path"]) if scope["type"] == "http" else None
        if kind is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":  # as Starlette answered it, with the OpenAI body
            not_allowed = errors.APIError(
                405, "Method Not Allowed", type="invalid_request_error", headers={"Allow": "POST"}
            )
            await error_response(not_allowed)(scope, receive, send)
            return
        # uvicorn gives lower-case names; the first of repeated headers wins, as in Starlette.
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in reversed(scope["headers"])}
        try:
            # With tenants the key is checked first: a stranger learns nothing, not even
            # whether its body would parse.
            tenant = self.proxy.authenticate(headers)
            await self.proxy.arrival_turn(tenant)
            body = await read_body(receive, headers.get("content-length"), self.max_body_bytes)
            parsed = parse(kind, body)
            response = await unless_gone(
                self.proxy.handle(kind, parsed, body, headers, tenant), receive
            )
        except ClientGone:
            return
        except errors.APIError as exc:
            response = error_response(exc)
        except Exception as exc:
            response = error_response(unexpected_error(exc))
        await response(scope, receive, send)


async def unless_gone(answer: Coroutine[Any, Any, Response], receive: Receive) -> Response:
    """The answer, unless the client disconnects first: a request held for a waking model or
    queued behind a saturated one is then dropped (cancelled: it leaves its queue) rather than
    served to no one. ClientGone in that case."""
    task = asyncio.ensure_future(answer)
    gone = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        discard_answer(task)
        raise
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    discard_answer(task)  # it may have finished before it saw the cancel
    raise ClientGone


def discard_answer(task: asyncio.Future[Response]) -> None:
    """A finished answer nobody will send: a relayed stream gives its replica slot and its
    tenant's accounting back (they are held until the response is done with)."""
    if task.done() and not task.cancelled() and task.exception() is None:
        response = task.result()
        if isinstance(response, RelayResponse):
            response.discard()


async def wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def unexpected_error(exc: Exception) -> errors.APIError:
    """The logged 500 any failure but an APIError becomes."""
    log.exception("unhandled error")
    return errors.internal_error(f"Internal server error: {exc!r}")


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise errors.too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    while True:
        message: dict[str, Any] = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise errors.too_large(None, limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
