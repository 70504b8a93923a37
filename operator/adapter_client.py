"""The engine's adapter API as the operator calls it, over pod IPs: GET /v1/models, POST
LOAD_LORA_PATH and UNLOAD_LORA_PATH (contract/lora.py). One pooled httpx client, as the metrics
scraper has; every call bounded by a timeout; trouble is a value, never an exception.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from kvpilot.contract.lora import (
    LOAD_LORA_PATH,
    UNLOAD_LORA_PATH,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from kvpilot.operator.adapters import Action, Load, Result, parse_models

MODELS_PATH = "/v1/models"
MAX_MESSAGE_BYTES = 4096


@dataclass(frozen=True)
class AdapterClientTimeouts:
    """Seconds each call may take. A load includes the engine reading (or downloading) the
    files; one that outlasts it is Loading, and the next round sees it loaded or asks again."""

    list_s: float = 5.0
    load_s: float = 120.0
    unload_s: float = 30.0

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")


def base_url(pod_ip: str, port: int) -> str:
    host = f"[{pod_ip}]" if ":" in pod_ip else pod_ip  # IPv6 pod IPs need brackets
    return f"http://{host}:{port}"


class AdapterClient:
    """Calls one engine's adapter API at a time; shared by every InferenceService."""

    def __init__(
        self,
        client: httpx.AsyncClient | None = None,
        *,
        timeouts: AdapterClientTimeouts | None = None,
    ) -> None:
        self.timeouts = timeouts or AdapterClientTimeouts()
        self._is_own_client = client is None
        # trust_env=False: pod IPs must never be sent through an HTTP(S)_PROXY from the env.
        self._client = client or httpx.AsyncClient(trust_env=False)

    async def list_loaded(self, url: str, api_key: str | None) -> dict[str, str] | str:
        """{adapter: root} the engine at `url` reports, or why there is no answer."""
        try:
            response = await asyncio.wait_for(
                self._client.get(
                    f"{url}{MODELS_PATH}", headers=_headers(api_key), timeout=self.timeouts.list_s
                ),
                self.timeouts.list_s,
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return f"{url}{MODELS_PATH} did not answer in {self.timeouts.list_s:g}s"
        except httpx.HTTPError as exc:
            return f"{url}{MODELS_PATH}: {type(exc).__name__}: {exc}"
        if response.status_code != 200:
            return f"{url}{MODELS_PATH} answered HTTP {response.status_code}: {_text(response)}"
        try:
            return parse_models(response.json())
        except ValueError as exc:
            return f"{url}{MODELS_PATH}: {exc}"

    async def run(self, url: str, api_key: str | None, action: Action) -> Result:
        """One load or unload on the engine at `url`; its answer, or None as the status with
        the reason there was none."""
        if isinstance(action, Load):
            path, timeout = LOAD_LORA_PATH, self.timeouts.load_s
            body = LoadLoRAAdapterRequest(
                lora_name=action.name, lora_path=action.path, load_inplace=action.replace
            ).model_dump()
        else:
            path, timeout = UNLOAD_LORA_PATH, self.timeouts.unload_s
            body = UnloadLoRAAdapterRequest(lora_name=action.name).model_dump(exclude_none=True)
        try:
            response = await asyncio.wait_for(
                self._client.post(
                    f"{url}{path}", json=body, headers=_headers(api_key), timeout=timeout
                ),
                timeout,
            )
        except (asyncio.TimeoutError, httpx.TimeoutException):
            return Result(action, None, f"no answer from {url}{path} in {timeout:g}s")
        except httpx.HTTPError as exc:
            return Result(action, None, f"{url}{path}: {type(exc).__name__}: {exc}")
        return Result(action, response.status_code, _text(response))

    async def aclose(self) -> None:
        if self._is_own_client:
            await self._client.aclose()


def _headers(api_key: str | None) -> dict[str, str]:
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def _text(response: httpx.Response) -> str:
    """The engine's message: an OpenAI error body's message, else the plain text."""
    text = response.content[:MAX_MESSAGE_BYTES].decode("utf-8", "replace").strip()
    try:
        body = response.json()
    except ValueError:
        return text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and isinstance(error.get("message"), str):
            return error["message"]
        if isinstance(body.get("message"), str):
            return body["message"]
        if isinstance(body.get("detail"), str):
            return body["detail"]
    return text
