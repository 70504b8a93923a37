from __future__ import annotations

import re

import pytest

from kvpilot.operator.modeluri import (
    URI_PATTERN,
    BuiltinModel,
    FileModel,
    HfModel,
    PvcModel,
    parse_model_uri,
)

GOOD = [
    ("hf://Qwen/Qwen2.5-0.5B-Instruct", HfModel("Qwen/Qwen2.5-0.5B-Instruct", None)),
    ("hf://meta-llama/Llama-3.1-8B@main", HfModel("meta-llama/Llama-3.1-8B", "main")),
    ("hf://org/name@refs/pr/3", HfModel("org/name", "refs/pr/3")),
    ("hf://org/name@" + "a" * 40, HfModel("org/name", "a" * 40)),
    ("pvc://models/llama/8b", PvcModel("models", "llama/8b")),
    ("pvc://models", PvcModel("models", "")),
    ("pvc://models/", PvcModel("models", "")),
    ("file:///opt/models/llama", FileModel("/opt/models/llama")),
    ("builtin://smollm2-135m-instruct", BuiltinModel("smollm2-135m-instruct")),
]


@pytest.mark.parametrize(("uri", "expected"), GOOD)
def test_parses_every_scheme(uri: str, expected: object) -> None:
    assert parse_model_uri(uri) == expected
    # The CRD pattern (what the API server checks) accepts exactly what the parser accepts.
    assert re.fullmatch(URI_PATTERN, uri)


@pytest.mark.parametrize(
    ("uri", "message"),
    [
        ("s3://bucket/model", "unknown scheme 's3'"),
        ("Qwen/Qwen2.5", "has no scheme"),
        ("hf://just-a-name", "expected hf://org/name"),
        ("hf://a/b/c", "expected hf://org/name"),
        ("hf://org/name@", "not a valid revision"),
        ("hf://org/name@bad rev", "not a valid revision"),
        ("pvc://Bad_Claim/x", "not a valid PersistentVolumeClaim name"),
        ("pvc://claim/../etc", "'..' may not appear"),
        ("file://relative/path", "absolute path"),
        ("file:///", "absolute path"),
        ("builtin://gpt-5", "unknown builtin model 'gpt-5'"),
    ],
)
def test_rejects_with_a_message_naming_the_problem(uri: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_model_uri(uri)
    if "'..'" not in message:  # the parser is stricter than the regex about '..' only
        assert not re.fullmatch(URI_PATTERN, uri)


@pytest.mark.parametrize(
    ("uri", "local_dir"),
    [
        ("hf://org/name", "/models/hf/org/name/main"),
        ("hf://org/name@v1.0", "/models/hf/org/name/v1.0"),
        ("hf://org/name@refs/pr/3", "/models/hf/org/name/refs--pr--3"),
        ("pvc://claim/llama/8b", "/models/llama/8b"),
        ("pvc://claim", "/models"),
        ("file:///opt/m", "/opt/m"),
        ("builtin://smollm2-135m-instruct", None),
    ],
)
def test_local_dir_is_where_the_engine_finds_the_weights(uri: str, local_dir: str | None) -> None:
    assert parse_model_uri(uri).local_dir == local_dir
