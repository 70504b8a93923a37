"""What `kvpilot serve` tells its operator: a port in use ends it before anything loads, one
`ready at URL` line when /ready turns 200 (the big-body worker started with it), and a log line per
request that never carries a key, a query string or a body."""

from __future__ import annotations

import logging
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import httpx
import pytest

from kvpilot.engine.server.access_log import access_logger
from kvpilot.engine.server.async_engine import AsyncEngine
from kvpilot.engine.server.cli import open_listener
from kvpilot.engine.server.from_flags import parse_flags, server_settings
from kvpilot.engine.server.inprocess import InProcessServer, serve_in_thread
from kvpilot.engine.server.run import DrainingServer, base_url
from kvpilot.engine.server.settings import ServerSettings
from kvpilot.engine.server.state import ServerState

SECRET_KEY = "sk-never-logged-7f3a"
SECRET_PROMPT = "a prompt that stays out of the log"
ACCESS_LINE = re.compile(r"^(GET|POST) (\S+) (\d{3}) \d+\.\d ms$")


def test_a_port_in_use_ends_serve_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "kvpilot.cli", "serve", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 1, result.stderr[-4000:]
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert "loading" not in result.stderr and "engine core" not in result.stderr, result.stderr


def test_the_listener_is_opened_with_its_real_port() -> None:
    listener = open_listener("127.0.0.1", 0)
    try:
        assert base_url("127.0.0.1", listener) == f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(OSError, match=r"cannot listen on 127\.0\.0\.1:\d+"):
            open_listener("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()


def access_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == access_logger.name]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_each_request_is_logged_without_its_key_query_or_body(
    make_server: Callable[[ServerSettings], InProcessServer],
    model_name: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=access_logger.name)
    live = make_server(ServerSettings(api_key=SECRET_KEY))
    auth = {"Authorization": f"Bearer {SECRET_KEY}"}
    body = {"model": model_name, "prompt": SECRET_PROMPT, "max_tokens": 2}
    with httpx.Client(base_url=live.url, timeout=60) as http:
        assert http.post("/v1/completions", json=body, headers=auth).status_code == 200
        assert http.get(f"/v1/models?key={SECRET_KEY}", headers=auth).status_code == 200
        assert http.post("/v1/completions", json=body).status_code == 401
        assert http.get("/health").status_code == 200
    wait_for(lambda: len(access_lines(caplog)) >= 3, "three access log lines")
    lines = access_lines(caplog)
    parsed = [ACCESS_LINE.match(line) for line in lines]
    assert all(parsed), lines
    assert [m.group(1, 2, 3) for m in parsed if m] == [
        ("POST", "/v1/completions", "200"),
        ("GET", "/v1/models", "200"),
        ("POST", "/v1/completions", "401"),
    ]  # /health only at DEBUG
    logged = caplog.text
    assert SECRET_KEY not in logged and SECRET_PROMPT not in logged


def test_the_access_log_is_off_with_its_flag(
    make_server: Callable[[ServerSettings], InProcessServer], caplog: pytest.LogCaptureFixture
) -> None:
    settings = server_settings(parse_flags(["--disable-uvicorn-access-log"]))
    assert settings.access_log is False and server_settings(parse_flags([])).access_log is True
    caplog.set_level(logging.DEBUG, logger=access_logger.name)
    live = make_server(settings)
    assert httpx.get(f"{live.url}/v1/models", timeout=30).status_code == 200
    assert access_lines(caplog) == []


def test_ready_is_logged_once_and_starts_the_big_body_worker(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    """On the shared (loaded) engine: the first tick after /ready turns 200 logs the URL and
    starts the worker that parses bodies over 1 MiB, which loads its tokenizer before any big
    request comes."""
    caplog.set_level(logging.INFO, logger="kvpilot.server")
    state = ServerState(engine)
    url = "http://127.0.0.1:8000"
    live = serve_in_thread(
        state, make_server=lambda config: DrainingServer(config, state, 1.0, url)
    )
    try:
        wait_for(lambda: f"ready at {url}" in caplog.text, "the ready line")
        assert httpx.get(f"{live.url}/ready", timeout=10).status_code == 200
        assert state.big_body_worker_up is not None
        assert state.big_body_worker_up.result(timeout=120) == 0
        assert caplog.text.count("ready at") == 1
    finally:
        live.stop()
        state.close()
