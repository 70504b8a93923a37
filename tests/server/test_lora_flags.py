"""`kvpilot serve`'s adapter flags, as vLLM spells them: what parse_flags (and so the operator's
check of extraArgs) accepts and refuses, and the engine config they make."""

from __future__ import annotations

import pytest

from kvpilot.contract.engine_flags import FlagError
from kvpilot.contract.lora import RUNTIME_LORA_ENV
from kvpilot.engine.server.from_flags import engine_config, parse_flags, with_runtime_lora_env


def test_adapter_flags_make_the_lora_config() -> None:
    args = parse_flags(
        [
            "--enable-lora",
            "--lora-modules",
            "sql=/adapters/sql",
            '{"name": "chat", "path": "org/chat-lora", "base_model_name": "m"}',
            "--lora-modules",
            "third=/a/b",
            "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "8",
        ]
    )  # fmt: skip
    lora = engine_config(args).lora
    assert lora is not None
    assert lora.modules == (("sql", "/adapters/sql"), ("chat", "org/chat-lora"), ("third", "/a/b"))
    assert (lora.max_loras, lora.max_lora_rank, lora.resolved_max_cpu_loras) == (4, 64, 8)
    assert not lora.allow_runtime_updating
    assert engine_config(parse_flags([])).lora is None


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--lora-modules", "a=/x"], "need --enable-lora"),
        (["--allow-runtime-lora-updating"], "need --enable-lora"),
        (["--enable-lora", "--lora-modules", "a"], "name=path or JSON"),
        (["--enable-lora", "--lora-modules", "bad name=/x"], "letters, digits"),
        (["--enable-lora", "--lora-modules", "a=/x", "a=/y"], "distinct names"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], '"path"'),
        (["--enable-lora", "--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras"),
        (["--enable-lora", "--max-lora-rank", "1024"], "max_lora_rank"),
        (["--enable-lora", "--max-loras", "0"], "must be >= 1"),
    ],
)
def test_bad_adapter_flags_are_refused_before_anything_starts(argv: list[str], why: str) -> None:
    with pytest.raises(FlagError, match=why):
        parse_flags(argv)


def test_vllms_environment_variable_switches_runtime_loading_on() -> None:
    config = engine_config(parse_flags(["--enable-lora"]))
    assert with_runtime_lora_env(config, {RUNTIME_LORA_ENV: "True"}).lora.allow_runtime_updating
    assert not with_runtime_lora_env(config, {RUNTIME_LORA_ENV: "0"}).lora.allow_runtime_updating
    flagged = engine_config(parse_flags(["--enable-lora", "--allow-runtime-lora-updating"]))
    assert flagged.lora is not None and flagged.lora.allow_runtime_updating
    # Without --enable-lora the variable changes nothing (vLLM ignores it too).
    plain = engine_config(parse_flags([]))
    assert with_runtime_lora_env(plain, {RUNTIME_LORA_ENV: "True"}).lora is None
