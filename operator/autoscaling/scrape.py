"""Reading the engine's own /metrics from each Ready pod: concurrent, short timeout, never a guess.

A scrape that fails in any way (connect, timeout, non-200, oversized, unparsable, or lacking the
gauges) yields a ScrapeError, which the autoscaler treats as "missing", never as an idle pod.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvpilot.contract.load_metrics import (
    GPU_CACHE_USAGE,
    KV_CACHE_USAGE,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
    VLLM,
    engine_names,
)
from kvpilot.operator.autoscaling.observations import PodMetrics

# kvpilot's own names first, then the vLLM-compatible aliases the engine also exports
# (and vLLM's older name for the KV-cache gauge), so any vLLM-compatible server works too.
WAITING_NAMES = engine_names(NUM_REQUESTS_WAITING)
RUNNING_NAMES = engine_names(NUM_REQUESTS_RUNNING)
KV_USAGE_NAMES = (*engine_names(KV_CACHE_USAGE), f"{VLLM}:{GPU_CACHE_USAGE.name}")
DEFAULT_TIMEOUT_S = 1.0
MAX_BODY_BYTES = 4 * 1024 * 1024
SCRAPE_ERROR_KINDS = ("timeout", "connect", "http_status", "too_large", "parse", "no_ip")


class MetricsParseError(ValueError):
    """The text is not Prometheus exposition format, or lacks or garbles the gauges we need."""


@dataclass(frozen=True)
class ScrapeTarget:
    name: str  # the pod's name
    url: str | None  # None when a Ready pod has no IP yet: reported as an error, not skipped


@dataclass(frozen=True)
class ScrapeError:
    kind: str  # one of SCRAPE_ERROR_KINDS
    detail: str


ScrapeResult = PodMetrics | ScrapeError
Scrape = Callable[[Sequence[ScrapeTarget]], Awaitable[dict[str, ScrapeResult]]]


def metrics_url(pod_ip: str | None, port: int) -> str | None:
    if not pod_ip:
        return None
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod IPs need brackets
    return f"http://{host}:{port}/metrics"


def parse_metrics(text: str) -> PodMetrics:
    """Prometheus text -> PodMetrics. Sums counts over model_name labels; KV usage is the max."""
    try:
        families = {family.name: family for family in text_string_to_metric_families(text)}
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise MetricsParseError(f"not Prometheus text: {exc}") from exc
    waiting = _read(families, WAITING_NAMES, sum)
    kv_usage = _read(families, KV_USAGE_NAMES, max)
    if waiting is None or kv_usage is None:
        wanted = (WAITING_NAMES if waiting is None else KV_USAGE_NAMES)[0]
        raise MetricsParseError(f"no {wanted} (nor its vllm: alias) in the metrics")
    if kv_usage > 1.0 + 1e-6:
        raise MetricsParseError(
            f"KV-cache usage {kv_usage} is above 1: expected a fraction in [0, 1]"
        )
    return PodMetrics(
        num_waiting=waiting,
        kv_cache_usage=min(kv_usage, 1.0),
        num_running=_read(families, RUNNING_NAMES, sum),
    )


def _read(
    families: Mapping[str, object],
    names: Sequence[str],
    combine: Callable[[Iterable[float]], float],
) -> float | None:
    for name in names:
        family = families.get(name)
        if family is None:
            continue
        values = [s.value for s in family.samples if s.name == name]  # type: ignore[attr-defined]
        if not values:
            continue
        for value in values:
            if not math.isfinite(value) or value < 0:
                raise MetricsParseError(f"{name} has an invalid value {value}")
        return float(combine(values))
    return None


class MetricsScraper:
    """Scrapes many pods concurrently over one pooled client. Callable as a `Scrape`."""

    def __init__(
        self,
        client: httpx.AsyncClient | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._is_own_client = client is None
        # trust_env=False: pod IPs must never be sent through an HTTP(S)_PROXY from the env.
        self._client = client or httpx.AsyncClient(trust_env=False)

    async def __call__(self, targets: Sequence[ScrapeTarget]) -> dict[str, ScrapeResult]:
        results = await asyncio.gather(*(self.scrape_one(target) for target in targets))
        return {target.name: result for target, result in zip(targets, results, strict=True)}

    async def scrape_one(self, target: ScrapeTarget) -> ScrapeResult:
        text = await self.fetch_text(target)
        if isinstance(text, ScrapeError):
            return text
        try:
            return parse_metrics(text)
        except MetricsParseError as exc:
            return ScrapeError("parse", f"{target.url}: {exc}")

    async def fetch_text(self, target: ScrapeTarget) -> str | ScrapeError:
        """The target's metrics text, or why there is none (any /metrics: engines, routers)."""
        if target.url is None:
            return ScrapeError("no_ip", "the pod is Ready but has no IP")
        try:
            # httpx's timeout bounds each phase; wait_for bounds the whole scrape, so that
            # a server dripping bytes cannot stall the tick.
            body = await asyncio.wait_for(self._fetch(target.url), self.timeout_s)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return ScrapeError("timeout", f"no answer from {target.url} in {self.timeout_s:g}s")
        except _HttpStatusError as exc:
            return ScrapeError("http_status", str(exc))
        except _TooLargeError as exc:
            return ScrapeError("too_large", str(exc))
        except httpx.HTTPError as exc:
            return ScrapeError("connect", f"{target.url}: {type(exc).__name__}: {exc}")
        try:
            return body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return ScrapeError("parse", f"{target.url}: the body is not UTF-8: {exc}")

    async def _fetch(self, url: str) -> bytes:
        async with self._client.stream("GET", url, timeout=self.timeout_s) as response:
            if response.status_code != 200:
                raise _HttpStatusError(f"{url} answered HTTP {response.status_code}")
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise _TooLargeError(f"{url} sent more than {self.max_body_bytes} bytes")
        return bytes(body)

    async def aclose(self) -> None:
        if self._is_own_client:
            await self._client.aclose()


class _HttpStatusError(Exception):
    pass


class _TooLargeError(Exception):
    pass
