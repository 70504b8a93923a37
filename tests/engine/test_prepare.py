"""`kvpilot prepare` and what a start takes from it: CPU kernels prebuilt per instruction set and
found by this CPU's features, a model converted into a named cache, GGUF model directories."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvpilot.engine.cpu import build
from kvpilot.engine.model.gguf_convert import ModelFileError, gguf_cache_dir, is_converted
from kvpilot.engine.model.loader import bundled_gguf_path, gguf_in_dir, resolve_model
from kvpilot.engine.prepare import main

V4 = build.ISAS[1].cpu_flags


def fake_prebuilt(root: Path, names: list[str], key: str = "k") -> None:
    for name in names:
        (root / key / name).mkdir(parents=True)
        (root / key / name / build.LIBRARY_NAME).write_bytes(b"")


def test_a_cpu_takes_the_richest_prebuilt_library_it_can_run(tmp_path: Path) -> None:
    fake_prebuilt(tmp_path, ["avx2", "avx512", "avx512bf16"])
    pick = build.find_prebuilt
    assert pick(tmp_path, V4 | {"avx512_bf16"}, "k")[0].name == "avx512bf16"  # type: ignore[index]
    assert pick(tmp_path, V4, "k")[0].name == "avx512"  # type: ignore[index]
    assert pick(tmp_path, build.ISAS[2].cpu_flags, "k")[0].name == "avx2"  # type: ignore[index]
    assert pick(tmp_path, frozenset({"sse2", "avx"}), "k") is None  # unknown CPU: compiled here


def test_a_library_built_from_other_sources_is_never_taken(tmp_path: Path) -> None:
    fake_prebuilt(tmp_path, ["avx2"], key="0123456789abcdef")
    assert build.source_key() != "0123456789abcdef"
    assert build.find_prebuilt(tmp_path, V4 | {"avx512_bf16"}) is None


@pytest.mark.slow  # two compiles of the kernels: 5-30 s
@pytest.mark.skipif(
    not build.ISAS[2].cpu_flags <= build.cpu_flags() or build.c_compiler() is None,
    reason="needs an AVX2 CPU and a C compiler",
)
def test_an_engine_loads_prebuilt_kernels_without_compiling(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernels = tmp_path / "kernels"
    assert main(["--kernels-dir", str(kernels), "--isa", "avx2"]) == 0
    found = build.find_prebuilt(kernels, build.cpu_flags())
    assert found is not None and found[0].name == "avx2"
    assert found[1] == kernels / build.source_key() / "avx2" / build.LIBRARY_NAME
    # No compiler and an empty cache: only the prebuilt library can answer.
    monkeypatch.setenv(build.PREBUILT_ENV, str(kernels))
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-compiler"))
    lib = build.load_library.__wrapped__()
    assert lib is not None and lib._name == str(found[1])
    assert lib.kvpilot_linear_available() in (0, 1)
    assert lib.kvpilot_openmp_threads() >= 1
    assert not (tmp_path / "empty-cache").exists()


def test_prepare_refuses_an_unknown_instruction_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--kernels-dir", str(tmp_path), "--isa", "sse9"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'sse9'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown instruction sets"):
        build.build_prebuilt(tmp_path, ("sse9",))


def test_prepare_converts_into_the_named_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The default cache holds the bundled model converted (the engine tests convert it once); a
    # named cache is another root: its digest memo and directory lie under it.
    gguf = bundled_gguf_path()
    default_dir = gguf_cache_dir(gguf)
    cache = tmp_path / "volume"
    (cache / "gguf").mkdir(parents=True)
    if is_converted(default_dir):  # copied rather than converted again: seconds, not tens
        os.symlink(default_dir, cache / "gguf" / default_dir.name)
    assert main([str(gguf), "--cache-dir", str(cache)]) == 0
    out = cache / "gguf" / default_dir.name
    assert is_converted(out)
    assert f"converted model: {out}" in capsys.readouterr().out
    assert len(list((cache / "gguf" / "digests").iterdir())) == 1


def test_prepare_says_what_is_wrong_with_a_damaged_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "m" / "model.gguf"
    bad.parent.mkdir()
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    assert main([str(bad.parent), "--cache-dir", str(tmp_path / "cache")]) == 1
    assert "not a readable GGUF file" in capsys.readouterr().err
    assert not list((tmp_path / "cache" / "gguf").glob("sha256-*/model.safetensors"))


def test_a_gguf_model_directory_resolves_to_its_conversion(tmp_path: Path) -> None:
    # An hf:// download of a GGUF repo is a directory holding the file, no config.json.
    (tmp_path / "sub").mkdir()
    os.symlink(bundled_gguf_path(), tmp_path / "sub" / "model.Q4_1.gguf")
    assert gguf_in_dir(tmp_path) == tmp_path / "sub" / "model.Q4_1.gguf"
    resolved = resolve_model(str(tmp_path), "auto")
    assert resolved.hf_dir == gguf_cache_dir(bundled_gguf_path())
    assert resolved.name == "model.Q4_1"
    os.symlink(bundled_gguf_path(), tmp_path / "other.gguf")
    with pytest.raises(ModelFileError, match="several GGUF files"):
        gguf_in_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert gguf_in_dir(tmp_path) is None
    with pytest.raises(ModelFileError, match=r"no config\.json"):
        gguf_in_dir(_empty(tmp_path))


def _empty(root: Path) -> Path:
    empty = root / "empty"
    empty.mkdir()
    return empty
