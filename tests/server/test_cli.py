"""`kvpilot serve` flags: their mapping onto the engine configs, and clear errors on bad values."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpilot.engine.server.cli import build_parser, engine_config, main


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
