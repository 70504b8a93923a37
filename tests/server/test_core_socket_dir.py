"""The engine core's sockets find a directory whose path a Unix socket can have, even where the
temporary directory's path is too long (a deep emptyDir mount, pytest's per-worker tmp path)."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

import pytest
import zmq

from kvpilot.engine.core.client import IPC_PATH_MAX, SOCKET_NAMES, private_socket_dir


def test_a_too_long_tmpdir_falls_back_to_a_short_private_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    path = private_socket_dir()
    try:
        assert not path.startswith(str(deep)), path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700  # only this user may send commands
        assert list(deep.iterdir()) == []  # the directory that did not fit is removed
        context = zmq.Context()
        try:
            for name in SOCKET_NAMES:
                sock = context.socket(zmq.PULL)
                sock.bind(f"ipc://{path}/{name}")  # would raise for a path over the limit
                sock.close(linger=0)
        finally:
            context.term()
    finally:
        for name in SOCKET_NAMES:
            Path(path, name).unlink(missing_ok=True)
        os.rmdir(path)


def test_the_temporary_directory_is_used_where_it_fits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    short = Path(tempfile.mkdtemp(prefix="k", dir="/tmp"))
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(short))
        path = private_socket_dir()
        assert Path(path).parent == short
        os.rmdir(path)
    finally:
        os.rmdir(short)


def test_no_fitting_directory_is_a_clear_error(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * IPC_PATH_MAX)
    deep.mkdir()
    with pytest.raises(RuntimeError, match="set TMPDIR to a short writable path") as raised:
        private_socket_dir((str(deep), str(tmp_path / "missing")))
    assert "longer than a Unix socket's path may be" in str(raised.value)
    assert "No such file or directory" in str(raised.value)
    assert list(deep.iterdir()) == []
