"""The model-fetch init container against a loopback Hugging Face Hub, through huggingface_hub."""

from __future__ import annotations

import hashlib
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from kvpilot.operator.modelfetch import main

COMMIT = "c0ffee" + "0" * 34
FILES = {
    "config.json": b'{"model_type": "llama"}',
    "model.safetensors": b"\x00" * 2048,
    "original/consolidated.pth": b"\x01" * 1024,  # a duplicate of the weights nobody needs
}


class FakeHub(http.server.BaseHTTPRequestHandler):
    """The few Hub endpoints snapshot_download uses; "gated/*" repos answer 403 like the Hub."""

    requests: ClassVar[list[str]] = []

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _serve(self, send_body: bool) -> None:
        type(self).requests.append(f"{self.command} {self.path}")
        path = self.path.split("?")[0]
        if "/gated/" in path or path.startswith("/gated/"):
            headers = {
                "X-Error-Code": "GatedRepo",
                "X-Error-Message": "Access to model is restricted",
            }
            return self._reply(403, b"{}", headers, send_body)
        if "/tree/" in path:
            tree = [
                {
                    "type": "file",
                    "path": name,
                    "size": len(data),
                    "oid": hashlib.sha1(data).hexdigest(),
                }
                for name, data in FILES.items()
            ]
            return self._reply(
                200, json.dumps(tree).encode(), {"Content-Type": "application/json"}, send_body
            )
        if path.startswith("/api/models/"):
            info = {"id": "org/model", "sha": COMMIT, "siblings": [{"rfilename": n} for n in FILES]}
            return self._reply(
                200, json.dumps(info).encode(), {"Content-Type": "application/json"}, send_body
            )
        for name, data in FILES.items():
            if path.endswith(f"/resolve/{COMMIT}/{name}"):
                etag = hashlib.sha256(data).hexdigest()
                headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{etag}"'}
                return self._reply(200, data, headers, send_body)
        return self._reply(404, b"", {"X-Error-Code": "EntryNotFound"}, send_body)

    def do_GET(self) -> None:
        self._serve(send_body=True)

    def do_HEAD(self) -> None:
        self._serve(send_body=False)


@pytest.fixture()
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """The init container is its own process, online. In this test process the engine tests may
    have set the engine's offline default before huggingface_hub was imported (it reads the flag
    once, at import)."""
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.fixture()
def hub(monkeypatch: pytest.MonkeyPatch, online: None) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    FakeHub.requests = []
    yield url
    server.shutdown()
    server.server_close()


def test_downloads_only_the_allowed_files_and_skips_them_next_time(
    hub: str, tmp_path: Path
) -> None:
    dest = tmp_path / "models" / "org" / "model" / "main"
    argv = ["--repo", "org/model", "--dest", str(dest), "--termination-log", str(tmp_path / "log")]
    argv += ["--allow-pattern", "*.json", "--allow-pattern", "*.safetensors"]
    assert main(argv) == 0
    assert (dest / "config.json").read_bytes() == FILES["config.json"]
    assert (dest / "model.safetensors").read_bytes() == FILES["model.safetensors"]
    assert not (dest / "original").exists()
    downloads = [r for r in FakeHub.requests if r.startswith("GET") and "/resolve/" in r]
    assert len(downloads) == 2

    FakeHub.requests = []
    assert main(argv) == 0  # a cache claim survives pods: nothing is fetched twice
    assert not [r for r in FakeHub.requests if r.startswith("GET") and "/resolve/" in r]


def test_gated_model_fails_with_the_fix_in_the_termination_log(hub: str, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    argv = ["--repo", "gated/model", "--dest", str(tmp_path / "m"), "--termination-log", str(log)]
    assert main(argv) == 1
    assert "spec.model.tokenSecret" in log.read_text()


def test_patterns_matching_no_model_file_fail_clearly(hub: str, tmp_path: Path) -> None:
    log = tmp_path / "termination-log"
    argv = ["--repo", "org/model", "--dest", str(tmp_path / "m"), "--termination-log", str(log)]
    assert main([*argv, "--allow-pattern", "*.gguf"]) == 1
    assert "check spec.model.allowPatterns" in log.read_text()


def test_unreachable_hub_fails_with_a_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, online: None
) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    log = tmp_path / "termination-log"
    argv = ["--repo", "org/model", "--dest", str(tmp_path / "m"), "--termination-log", str(log)]
    assert main(argv) == 1
    assert log.read_text().startswith("downloading org/model failed")


def test_a_downloaded_gguf_that_does_not_convert_fails_with_the_reason(
    hub: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(FILES, "model.Q4_0.gguf", b"GGUF" + b"\x00" * 64)
    monkeypatch.delitem(FILES, "config.json")
    log, dest, cache = tmp_path / "termination-log", tmp_path / "m", tmp_path / "cache"
    argv = ["--repo", "org/model", "--dest", str(dest), "--termination-log", str(log)]
    assert main([*argv, "--allow-pattern", "*.gguf"]) == 0  # without --cache-dir: fetched only
    assert main([*argv, "--allow-pattern", "*.gguf", "--cache-dir", str(cache)]) == 1
    text = log.read_text()
    assert text.startswith("converting the downloaded model failed")
    assert "not a readable GGUF file" in text


def test_an_hf_directory_needs_no_conversion(
    hub: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    argv = ["--repo", "org/model", "--dest", str(tmp_path / "m"), "--cache-dir", str(cache)]
    assert main([*argv, "--termination-log", str(tmp_path / "log")]) == 0
    assert "converted" not in capsys.readouterr().out
    assert not (cache / "gguf").exists()
