"""`kvpilot serve --tensor-parallel-size` as a real process: a size the model cannot take is refused
before anything starts, and a rank killed mid-stream ends the server with an error (the stream
ends, /health turns 503, the exit status is 1) well within the collectives' timeout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.engine.reference import save_tiny_hf_model

from .serve_process import child_pids, health_until_exit, is_running, launch_serve

DISTRIBUTED_TIMEOUT_S = 60  # the bound on a hang; a dead rank must end things much sooner
ENDS_WITHIN_S = 30


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.15,
    )  # fmt: skip
    return save_tiny_hf_model(config, tmp_path_factory.mktemp("tp") / "tiny")


def test_a_size_that_does_not_divide_the_heads_is_refused_before_any_process(
    tiny_model: Path,
) -> None:
    cmd = [sys.executable, "-m", "kvpilot.cli", "serve", "--model", str(tiny_model), "-tp", "3"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "tensor_parallel_size 3 does not divide the model's 4 attention heads" in done.stderr
    assert "Uvicorn running" not in done.stderr and "loading model" not in done.stderr


def worker_pids(core: int) -> list[int]:
    return [
        pid
        for pid in child_pids(core)
        if b"kvpilot.engine.executor.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]


def test_a_killed_rank_ends_the_server_with_an_error(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--tensor-parallel-size", "2", "--num-gpu-blocks-override",
            "300", "--distributed-timeout", str(DISTRIBUTED_TIMEOUT_S))  # fmt: skip
    with launch_serve(*args) as serve:
        core = serve.core_pid()
        (worker,) = worker_pids(core)
        body = {"prompt": [1, 2, 3], "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=DISTRIBUTED_TIMEOUT_S) as http:
            metrics = http.get(f"{serve.url}/metrics").text
            # The KV pool counts the whole model: 300 blocks, each on both ranks.
            assert 'parallel_config_info{model_name="tiny",tensor_parallel_size="2"} 1.0' in metrics
            assert 'num_gpu_blocks="300"' in metrics
            with http.stream("POST", f"{serve.url}/v1/completions", json=body) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                for _ in range(3):
                    next(lines)
                os.kill(worker, signal.SIGKILL)
                killed = time.monotonic()
                rest = list(lines)  # the stream ends (with an error), it does not hang
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][len("data: ") :])["error"]
            assert error["code"] == "internal_error", error
            healths = health_until_exit(serve, http)
        assert serve.proc.wait(timeout=ENDS_WITHIN_S) == 1, "".join(serve.log)
        assert time.monotonic() - killed < ENDS_WITHIN_S
        assert 503 in healths and 200 not in healths, healths
        log = "".join(serve.log)
        assert f"tensor-parallel rank 1 (pid {worker}) was killed by signal 9" in log, log
        assert not is_running(core)
