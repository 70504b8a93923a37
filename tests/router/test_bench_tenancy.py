"""bench/common/tenants.py (what bench/tenancy.py builds on): the manifests the router reads, a
streamed chat request sent with a tenant's key over a real socket, and Jain's index."""

from __future__ import annotations

import base64
import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml
from aiohttp import web

from kvpilot.contract.tenancy import PRIORITY_CLASSES
from kvpilot.contract.tenant_spec import parse_tenant_spec

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def tenants() -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module("common.tenants")


def test_manifests_are_tenants_and_secrets_the_operator_accepts(tenants: ModuleType) -> None:
    defs = [
        tenants.TenantDef("premium", "sk-p", "critical"),
        tenants.TenantDef("team", "sk-t", "standard", 2, {"tokensPerMinute": 3000}),
    ]
    documents = list(yaml.safe_load_all(tenants.manifests(defs)))
    assert [d["kind"] for d in documents] == ["Tenant", "Secret", "Tenant", "Secret"]
    specs = [parse_tenant_spec(d["spec"]) for d in documents if d["kind"] == "Tenant"]
    assert [s.weight for s in specs] == [1, 2]
    assert specs[1].quota is not None and specs[1].quota.tokens_per_minute == 3000
    assert "critical" in PRIORITY_CLASSES
    secret = documents[3]
    assert secret["metadata"]["name"] == documents[2]["spec"]["apiKeys"][0]["name"]
    assert base64.b64decode(secret["data"]["key"]) == b"sk-t"


async def test_a_chat_stream_carries_the_key_and_counts_chunks_and_usage(
    tenants: ModuleType,
) -> None:
    seen: list[str | None] = []

    async def chat(request: web.Request) -> web.StreamResponse:
        seen.append(request.headers.get("Authorization"))
        body = await request.json()
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in ("a", "b", ""):
            event = b'{"choices":[{"delta":{"content":"%s"}}]}' % piece.encode()
            await response.write(b"data: " + event + b"\n\n")
        usage = b'{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2}}'
        await response.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
        return response

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"code": "rate_limit_exceeded"}}, status=429)

    app = web.Application()
    app.router.add_post("/ok/v1/chat/completions", chat)
    app.router.add_post("/no/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        client = tenants.StreamClient(f"{base}/ok")
        reply = await tenants.stream_chat(client, body, "sk-x")
        anonymous = await tenants.stream_chat(client, body, None)
        refused = await tenants.stream_chat(tenants.StreamClient(f"{base}/no"), body, "sk-x")
    finally:
        await runner.cleanup()
    assert seen == ["Bearer sk-x", None]
    assert reply.status == 200 and len(reply.chunk_times) == 2
    assert (reply.prompt_tokens, reply.completion_tokens) == (7, 2)
    assert reply.ttft is not None and 0 < reply.ttft <= reply.end - reply.sent
    assert anonymous.status == 200
    assert refused.status == 429 and "rate_limit_exceeded" in refused.error
    assert refused.ttft is None


def test_jains_index(tenants: ModuleType) -> None:
    assert tenants.jain([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert tenants.jain([1.0, 0.0, 0.0]) == pytest.approx(1 / 3)
    assert tenants.jain([2.0, 1.0]) == pytest.approx(9 / 10)
    assert tenants.jain([]) == 0.0


def test_the_priority_case_pools_a_phases_rounds() -> None:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    tenancy = importlib.import_module("tenancy")

    def round_of(ttfts: list[float], chunks: int) -> dict[str, object]:
        return {
            "phase": "tenancy",
            "premium_requests": len(ttfts),
            "premium_refused": [],
            "premium_ttft_ms": ttfts,
            "burst_chunks_in_window": chunks,
            "window_s": 10.0,
            "load_average_1m": [1.0, 1.1],
        }

    first = [float(v) for v in range(1, 51)]
    pooled = tenancy.pool_rounds([round_of(first, 5), round_of([500.0, *first[1:]], 7)])
    assert pooled["premium_requests"] == 100 and pooled["burst_chunks_in_window"] == 12
    # The p99 of the hundred together: the slowest request of round 2 alone sets it.
    assert pooled["premium_ttft_p99_ms"] == round(50 + 0.01 * 450, 1)
    assert pooled["premium_ttft_max_ms"] == 500.0 and pooled["window_s"] == 20.0
