"""The converted-model cache: keyed by the GGUF's content (not its path), published once under a
lock by processes that race for it, never seen half-written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvpilot.engine.model.gguf_convert import content_digest, gguf_cache_dir, gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path
from kvpilot.engine.model.publish import publish_once

RACER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from kvpilot.engine.model.publish import publish_once

    dest, go, log = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    (go.parent / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.005)

    def build(tmp):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\\n")
        for i in range(20):  # slow enough that the other process arrives meanwhile
            (tmp / f"part{i}").write_text(str(os.getpid()))
            time.sleep(0.02)
        (tmp / "done").write_text(str(os.getpid()))

    built = publish_once(dest, build, lambda d: (d / "done").exists())
    print("built" if built else "reused")
    """
)


def test_two_processes_racing_build_the_entry_once(tmp_path: Path) -> None:
    dest, go, log = tmp_path / "cache" / "entry", tmp_path / "go", tmp_path / "builds"
    script = tmp_path / "racer.py"
    script.write_text(RACER)
    racers = [
        subprocess.Popen(
            [sys.executable, str(script), str(dest), str(go), str(log)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready-*"))) < 2:  # both imported and waiting at the gate
        assert time.monotonic() < deadline
        time.sleep(0.01)
    go.touch()
    outputs = sorted(p.communicate(timeout=60)[0].strip() for p in racers)
    assert [p.returncode for p in racers] == [0, 0]
    assert outputs == ["built", "reused"]
    assert len(log.read_text().split()) == 1  # one build, not two
    builder = (dest / "done").read_text()
    assert {(dest / f"part{i}").read_text() for i in range(20)} == {builder}  # one writer's set
    leftovers = [p.name for p in dest.parent.iterdir() if p.name.startswith(".partial")]
    assert leftovers == []


def test_a_failed_build_leaves_nothing_and_the_next_one_succeeds(tmp_path: Path) -> None:
    dest = tmp_path / "entry"

    def broken(tmp: Path) -> None:
        (tmp / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_once(dest, broken, lambda d: (d / "ok").exists())
    assert not dest.exists() and [p.name for p in tmp_path.iterdir()] == ["entry.lock"]
    assert publish_once(dest, lambda t: (t / "ok").write_text("1"), lambda d: (d / "ok").exists())


def test_the_key_is_the_content_not_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    original = bundled_gguf_path()
    copy = tmp_path / "elsewhere" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(original, copy)
    assert gguf_cache_dir(copy) == gguf_cache_dir(original)  # another path, same bytes
    os.utime(copy, (1, 1))  # a new mtime alone: hashed again, same key
    assert gguf_cache_dir(copy) == gguf_cache_dir(original)
    with open(copy, "r+b") as handle:  # one byte of tensor data changed
        handle.seek(-1, os.SEEK_END)
        last = handle.read(1)
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([last[0] ^ 1]))
    os.utime(copy, (2, 2))
    assert gguf_cache_dir(copy) != gguf_cache_dir(original)


def test_the_digest_is_hashed_once_per_file_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "cache"))
    source = tmp_path / "a.gguf"
    source.write_bytes(b"GGUF" + bytes(range(256)) * 100)
    first = content_digest(source)
    memos = list((tmp_path / "cache" / "gguf" / "digests").iterdir())
    assert len(memos) == 1 and memos[0].read_text() == first
    memos[0].write_text("f" * 64)  # the memo, not the bytes, answers for an unchanged file
    assert content_digest(source) == "f" * 64


def test_the_bundled_model_converts_into_a_content_keyed_directory() -> None:
    out = gguf_to_hf_dir(bundled_gguf_path())
    assert out.name == f"sha256-{content_digest(bundled_gguf_path())[:32]}"
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
