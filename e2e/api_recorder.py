"""A recording proxy in front of a real kube-apiserver: the processes of the chart's pods talk
to it (plain HTTP on loopback) with their ServiceAccount's token, it passes every request on to
the API server over TLS unchanged, streams the answer back (watches included) and records who
asked what and what the API server answered. What RBAC the chart grants is then checked against
the calls made: every call allowed (no 403), every rule used by some call.

The API server's authorizer sees the token, not the proxy: a call the ServiceAccount may not make
is refused exactly as it would be without the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import threading
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

# Hop-by-hop and framing headers: the proxy's own connection and framing replace them.
_NOT_FORWARDED = frozenset(
    {"host", "connection", "keep-alive", "transfer-encoding", "content-length", "upgrade"}
)


@dataclass(frozen=True)
class ApiCall:
    """One request as the API server's authorizer sees it (its RequestInfo)."""

    who: str  # whose token: the name the recorder was given for it
    verb: str  # get, list, watch, create, update, patch, delete, deletecollection
    group: str  # "" for the core group
    resource: str  # plural, with "/subresource" where there is one
    namespace: str  # "" for cluster-scoped calls
    status: int  # what the API server answered
    path: str


def request_info(method: str, path_qs: str) -> tuple[str, str, str, str] | None:
    """(verb, group, resource[/subresource], namespace) of a resource request; None for
    discovery and other non-resource paths (open to every authenticated client)."""
    url = urllib.parse.urlsplit(path_qs)
    parts = [p for p in url.path.split("/") if p]
    if parts[:1] == ["api"] and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    namespace = ""
    if rest[0] == "namespaces" and len(rest) >= 3:
        namespace, rest = rest[1], rest[2:]
    resource, name = rest[0], rest[1] if len(rest) > 1 else ""
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    query = urllib.parse.parse_qs(url.query)
    if method == "GET":
        is_watch = query.get("watch", ["false"])[0].lower() in ("true", "1")
        verb = "get" if name else ("watch" if is_watch else "list")
    elif method == "DELETE":
        verb = "delete" if name else "deletecollection"
    else:
        verb = {"POST": "create", "PUT": "update", "PATCH": "patch"}[method]
    return verb, group, resource, namespace


@dataclass
class ApiRecorder:
    """Proxies http://127.0.0.1:<port> to `upstream` (https) while started; `calls` holds every
    resource request made with a token given to `identify`."""

    upstream: str  # https://127.0.0.1:6443
    ca_file: str
    calls: list[ApiCall] = field(default_factory=list)
    port: int = 0
    _names: dict[str, str] = field(default_factory=dict)  # bearer token -> who
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _stopped: asyncio.Event | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def identify(self, token: str, who: str) -> None:
        with self._lock:
            self._names[token] = who

    def calls_of(self, who: str) -> list[ApiCall]:
        with self._lock:
            return [call for call in self.calls if call.who == who]

    def start(self) -> None:
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="api-recorder", daemon=True
        )
        self._thread.start()
        if not started.wait(30):
            raise RuntimeError("the API recorder did not start")

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(30)

    def _run(self, started: threading.Event) -> None:
        asyncio.run(self._serve(started))

    async def _serve(self, started: threading.Event) -> None:
        import aiohttp
        from aiohttp import web

        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        context = ssl.create_default_context(cafile=self.ca_file)
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=0),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
        )

        async def forward(request: web.Request) -> web.StreamResponse:
            headers = {k: v for k, v in request.headers.items() if k.lower() not in _NOT_FORWARDED}
            body = await request.read()
            async with session.request(
                request.method,
                self.upstream + request.path_qs,
                headers=headers,
                data=body or None,
                allow_redirects=False,
            ) as answer:
                self._record(request, answer.status)
                response = web.StreamResponse(status=answer.status)
                for key, value in answer.headers.items():
                    if key.lower() not in _NOT_FORWARDED:
                        response.headers.add(key, value)
                # A client that goes (a watch it stops, a pod stopped) ends the stream early.
                with contextlib.suppress(ConnectionResetError, aiohttp.ClientPayloadError):
                    await response.prepare(request)
                    async for chunk in answer.content.iter_any():
                        await response.write(chunk)
                    await response.write_eof()
                return response

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        started.set()
        await self._stopped.wait()
        await runner.cleanup()
        await session.close()

    def _record(self, request: Any, status: int) -> None:
        info = request_info(request.method, request.path_qs)
        if info is None:
            return
        token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        with self._lock:
            who = self._names.get(token, "unknown")
            self.calls.append(ApiCall(who, *info, status=status, path=request.path_qs))


@dataclass(frozen=True)
class Permission:
    """One (apiGroup, resource, verb) a Role or ClusterRole grants, and where it came from."""

    role: str
    group: str
    resource: str
    verb: str


def permissions(role: dict[str, Any]) -> list[Permission]:
    """Every (group, resource, verb) a rendered Role or ClusterRole grants."""
    name = role["metadata"]["name"]
    return [
        Permission(name, group, resource, verb)
        for rule in role.get("rules") or []
        for group in rule.get("apiGroups") or []
        for resource in rule.get("resources") or []
        for verb in rule.get("verbs") or []
    ]


def unused(granted: Iterable[Permission], calls: Iterable[ApiCall]) -> list[Permission]:
    """The permissions no call used (least privilege: this should be empty)."""
    used = {(c.group, c.resource, c.verb) for c in calls if c.status != 403}
    # A server-side apply that creates its object (201) is authorised as a create as well.
    used |= {
        (c.group, c.resource, "create") for c in calls if c.verb == "patch" and c.status == 201
    }
    return [p for p in granted if (p.group, p.resource, p.verb) not in used]


def refused(calls: Iterable[ApiCall]) -> list[ApiCall]:
    """The calls RBAC refused (sufficiency: this should be empty)."""
    return [call for call in calls if call.status == 403]
