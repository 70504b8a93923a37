"""The router's tenant directory: keys from Secrets to tenants (401s), grants (403s that say
nothing of whether a model exists), rotation by watch events, and the tenants file."""

from __future__ import annotations

import asyncio
import base64
import logging
from pathlib import Path
from typing import Any

import pytest

from kvpilot.contract import errors
from kvpilot.router.tenant_sources import follow_file, read_manifests
from kvpilot.router.tenants import (
    TenantDirectory,
    check_grant,
    check_route_grant,
    secret_digests,
)

NS = "teams"


def tenant(name: str, **spec: Any) -> dict[str, Any]:
    spec.setdefault("apiKeys", [{"name": f"{name}-keys"}])
    return {"kind": "Tenant", "metadata": {"name": name, "namespace": NS}, "spec": spec}


def secret(name: str, **keys: str) -> dict[str, Any]:
    data = {k: base64.b64encode(v.encode()).decode() for k, v in keys.items()}
    return {"kind": "Secret", "metadata": {"name": name, "namespace": NS}, "data": data}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def status_of(call: Any) -> int:
    with pytest.raises(errors.APIError) as caught:
        call()
    return caught.value.status_code


def directory_of(*objects: dict[str, Any]) -> TenantDirectory:
    directory = TenantDirectory()
    directory.replace(
        [o for o in objects if o["kind"] == "Tenant"],
        [o for o in objects if o["kind"] == "Secret"],
    )
    return directory


def test_keys_authenticate_their_tenant_and_nothing_else() -> None:
    directory = directory_of(
        tenant("alpha", models=["smol"]),
        secret("alpha-keys", current="sk-alpha-1", next="sk-alpha-2"),
        tenant("beta", models=["*"], apiKeys=[{"name": "beta-keys", "key": "api-key"}]),
        secret("beta-keys", **{"api-key": "sk-beta", "other": "sk-not-a-key-of-beta"}),
    )
    assert directory.authenticate(bearer("sk-alpha-1")).name == "alpha"
    assert directory.authenticate(bearer("sk-alpha-2")).name == "alpha"
    assert directory.authenticate({"authorization": "bearer sk-beta"}).name == "beta"
    # Only the named key of beta's Secret is a key.
    assert status_of(lambda: directory.authenticate(bearer("sk-not-a-key-of-beta"))) == 401
    assert status_of(lambda: directory.authenticate(bearer("sk-alpha-"))) == 401
    assert status_of(lambda: directory.authenticate({})) == 401
    assert status_of(lambda: directory.authenticate({"authorization": "Basic sk-beta"})) == 401


def test_401_bodies_are_openai_errors_and_never_echo_the_key() -> None:
    directory = directory_of(tenant("alpha"), secret("alpha-keys", k="sk-real"))
    with pytest.raises(errors.APIError) as caught:
        directory.authenticate(bearer("sk-guess-123"))
    body = caught.value.body()
    assert body["error"]["code"] == "invalid_api_key"
    assert "sk-guess-123" not in str(body) and "sk-real" not in str(body)
    assert caught.value.headers["WWW-Authenticate"] == "Bearer"


def test_rotation_and_removal_take_effect_at_the_next_event() -> None:
    directory = directory_of(tenant("alpha"), secret("alpha-keys", k="sk-old"))
    assert directory.authenticate(bearer("sk-old")).name == "alpha"
    directory.secret_event("MODIFIED", secret("alpha-keys", k="sk-new"))
    assert directory.authenticate(bearer("sk-new")).name == "alpha"
    assert status_of(lambda: directory.authenticate(bearer("sk-old"))) == 401
    directory.tenant_event("DELETED", tenant("alpha"))
    assert status_of(lambda: directory.authenticate(bearer("sk-new"))) == 401
    # A Tenant that names a Secret created later starts working when the Secret arrives.
    directory.tenant_event("ADDED", tenant("alpha"))
    directory.secret_event("DELETED", secret("alpha-keys"))
    assert status_of(lambda: directory.authenticate(bearer("sk-new"))) == 401
    directory.secret_event("ADDED", secret("alpha-keys", k="sk-late"))
    assert directory.authenticate(bearer("sk-late")).name == "alpha"


def test_a_namespace_listing_replaces_only_that_namespace() -> None:
    directory = TenantDirectory()
    other = {**tenant("gamma"), "metadata": {"name": "gamma", "namespace": "other"}}
    other_secret = secret("gamma-keys", k="sk-g")
    other_secret["metadata"]["namespace"] = "other"
    directory.tenants_listed("other", [other])
    directory.secrets_listed("other", [other_secret])
    directory.tenants_listed(NS, [tenant("alpha")])
    directory.secrets_listed(NS, [secret("alpha-keys", k="sk-a")])
    assert directory.authenticate(bearer("sk-g")).key == "other/gamma"
    directory.secrets_listed(NS, [])
    assert status_of(lambda: directory.authenticate(bearer("sk-a"))) == 401
    assert directory.authenticate(bearer("sk-g")).key == "other/gamma"


def test_an_invalid_tenant_is_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvpilot.router"):
        directory = directory_of(
            tenant("alpha", weight=0), secret("alpha-keys", k="sk-a"),
            tenant("beta"), secret("beta-keys", k="sk-b"),
        )  # fmt: skip
    assert status_of(lambda: directory.authenticate(bearer("sk-a"))) == 401
    assert directory.authenticate(bearer("sk-b")).name == "beta"
    assert "tenant teams/alpha is ignored" in caplog.text and "weight" in caplog.text
    assert "sk-a" not in caplog.text


def test_one_key_in_two_tenants_goes_to_the_first_by_name(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "kvpilot.router"):
        directory = directory_of(
            tenant("beta"), secret("beta-keys", k="sk-shared"),
            tenant("alpha"), secret("alpha-keys", k="sk-shared"),
        )  # fmt: skip
    assert directory.authenticate(bearer("sk-shared")).name == "alpha"
    assert "also a key of tenant" in caplog.text and "sk-shared" not in caplog.text


def test_grants_refuse_alike_whether_or_not_the_model_exists() -> None:
    directory = directory_of(
        tenant("alpha", models=["smol", "team-a-*"], adapters=["sql-*"]),
        secret("alpha-keys", k="sk-a"),
    )
    alpha = directory.authenticate(bearer("sk-a"))
    check_grant(alpha, "smol")
    check_grant(alpha, "team-a-llama")
    check_grant(alpha, "sql-expert")
    with pytest.raises(errors.APIError) as existing:
        check_grant(alpha, "premium-model")
    with pytest.raises(errors.APIError) as missing:
        check_grant(alpha, "no-such-model")
    assert existing.value.status_code == missing.value.status_code == 403
    assert existing.value.body()["error"]["message"].replace("premium-model", "X") == (
        missing.value.body()["error"]["message"].replace("no-such-model", "X")
    )
    # By kind: an adapter grant does not open a base model of that name, nor the reverse.
    check_route_grant(alpha, "sql-expert", is_adapter=True)
    assert status_of(lambda: check_route_grant(alpha, "sql-expert", is_adapter=False)) == 403
    assert status_of(lambda: check_route_grant(alpha, "smol", is_adapter=True)) == 403


def test_secret_digests_skip_what_is_not_a_key() -> None:
    digests = secret_digests(
        {"data": {"ok": base64.b64encode(b" sk-1\n").decode(), "bad": "%%%", "empty": ""},
         "stringData": {"plain": "sk-2"}}
    )  # fmt: skip
    assert sorted(digests) == ["ok", "plain"]
    assert all(len(d) == 32 for d in digests.values())


def test_manifests_file_is_followed_and_a_broken_one_keeps_the_last_good(
    tmp_path: Path,
) -> None:
    import yaml

    path = tmp_path / "tenants.yaml"
    path.write_text(yaml.safe_dump_all([tenant("alpha"), secret("alpha-keys", k="sk-1")]))
    tenants, secrets = read_manifests(path.read_text())
    assert [t["metadata"]["name"] for t in tenants] == ["alpha"] and len(secrets) == 1
    directory = TenantDirectory()

    async def run() -> None:
        task = asyncio.create_task(follow_file(str(path), directory, poll_s=0.01))
        try:
            await until(lambda: bool(directory.tenants))
            assert directory.authenticate(bearer("sk-1")).name == "alpha"
            path.write_text(yaml.safe_dump_all([tenant("alpha"), secret("alpha-keys", k="sk-22")]))
            await until(lambda: ok(directory, "sk-22"))
            assert not ok(directory, "sk-1")
            path.write_text("{not: [yaml")
            await asyncio.sleep(0.05)
            assert ok(directory, "sk-22")
        finally:
            task.cancel()

    asyncio.run(run())


def ok(directory: TenantDirectory, key: str) -> bool:
    try:
        directory.authenticate(bearer(key))
    except errors.APIError:
        return False
    return True


async def until(condition: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, "condition not met"
        await asyncio.sleep(0.01)
