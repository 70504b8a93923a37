"""`kvpilot serve` flags: their mapping onto the engine configs, and clear errors on bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine.server.cli import build_parser, engine_config, main, read_chat_template


def test_defaults_match_the_engine_defaults() -> None:
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.max_queue, args.shutdown_timeout) == (
        "127.0.0.1",
        8000,
        None,
        30.0,
    )
    config = engine_config(args)
    assert config.model is None and config.cache.enable_prefix_caching
    assert config.cache.block_size == 16 and config.scheduler.max_num_seqs == 128
    # Async scheduling by device: off on CPU, on for one CUDA rank, off under tensor parallelism.
    assert config.async_scheduling is None and not config.resolved_async_scheduling


def test_async_scheduling_flag() -> None:
    cuda = ["--device", "cuda"]
    resolved = {
        tuple(argv): engine_config(build_parser().parse_args(argv)).resolved_async_scheduling
        for argv in ([*cuda], [*cuda, "--no-async-scheduling"], ["--async-scheduling"],
                     [*cuda, "--tensor-parallel-size", "2"],
                     [*cuda, "--tensor-parallel-size", "2", "--async-scheduling"])
    }  # fmt: skip
    assert list(resolved.values()) == [True, False, True, False, False]


def test_flags_map_onto_engine_cache_and_scheduler_configs() -> None:
    args = build_parser().parse_args(
        [
            "--model", "/models/x.gguf", "--served-model-name", "x", "--dtype", "bfloat16",
            "--block-size", "32", "--max-model-len", "4096", "--max-num-seqs", "8",
            "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--kv-cache-gib", "2",
            "--gpu-memory-utilization", "0.5", "--attention-backend", "triton",
            "--load-format", "gguf", "--num-gpu-blocks-override", "64", "--seed", "7",
        ]
    )  # fmt: skip
    config = engine_config(args)
    assert config.model == "/models/x.gguf" and config.served_model_name == "x"
    assert config.dtype == "bfloat16" and config.max_model_len == 4096 and config.seed == 7
    assert config.attention_backend == "triton" and config.load_format == "gguf"
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_gib == 2 and config.cache.gpu_memory_utilization == 0.5
    assert config.cache.num_blocks == 64
    assert config.scheduler.max_num_seqs == 8 and config.scheduler.max_num_batched_tokens == 512


@pytest.mark.parametrize(
    "argv",
    [
        ["--max-num-seqs", "0"],
        ["--gpu-memory-utilization", "1.5"],
        ["--max-queue", "-1"],
        ["--shutdown-timeout", "-1"],
    ],
)
def test_invalid_values_exit_2_with_a_message(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "kvpilot serve:" in capsys.readouterr().err


def test_unknown_choice_is_an_argparse_error() -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["--block-size", "12"])
    assert info.value.code == 2


def test_a_model_that_cannot_load_exits_1(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["--model", str(missing), "--port", "0", "--log-level", "warning"]) == 1
    assert str(missing) in caplog.text


def test_the_api_key_comes_from_a_file_or_the_environment(tmp_path: Path) -> None:
    from kvpilot.engine.server.cli import API_KEY_ENV, resolve_api_key

    secret = tmp_path / "key"
    secret.write_text("s3cret\n")  # a mounted Secret usually ends in a newline
    assert resolve_api_key(None, str(secret), {API_KEY_ENV: "from-env"}) == "s3cret"
    assert resolve_api_key(None, None, {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key("flag", None, {API_KEY_ENV: "from-env"}) == "flag"
    assert resolve_api_key(None, None, {}) is None
    assert resolve_api_key(None, None, {API_KEY_ENV: ""}) is None
    with pytest.raises(ValueError, match="not both"):
        resolve_api_key("flag", str(secret), {})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        resolve_api_key(None, str(tmp_path / "empty"), {})
    with pytest.raises(ValueError, match="No such file"):
        resolve_api_key(None, str(tmp_path / "missing"), {})


def test_a_bad_api_key_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvpilot.engine.server.cli import main

    assert main(["--api-key-file", str(tmp_path / "missing")]) == 2
    assert "--api-key-file" in capsys.readouterr().err


def test_structured_output_and_tool_flags(tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["--guided-decoding-backend", "xgrammar", "--tool-call-parser", "mistral"]
    )
    assert engine_config(args).structured_outputs_backend == "xgrammar"
    assert args.tool_call_parser == "mistral"
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages }}")
    assert read_chat_template(str(template)) == "{{ messages }}"
    assert read_chat_template("{% for m in messages %}{% endfor %}").startswith("{%")
    assert read_chat_template(None) is None


def test_an_unreadable_chat_template_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template" in capsys.readouterr().err
