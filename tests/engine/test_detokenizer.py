"""The API side's text: the direct Rust decode is taken only where it equals the tokenizer's own
decode, and incremental detokenization adds up to decoding the whole output at once."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from kvpilot.engine.detokenizer import IncrementalDetokenizer, text_decoder
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path, load_tokenizer

# Multi-byte characters (split across byte-level BPE tokens), newlines, spacing, a special token.
TEXTS = (
    "Hello world! Ünïcödé, 日本語のテキスト, emoji 🦙🚀 and spaces   inside.",
    "def f(x):\n    return x ** 2  # squares\n\n<|im_end|> after a special token",
    " leading space, trailing space ",
)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(gguf_to_hf_dir(bundled_gguf_path()))


def hf_decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_the_bundled_tokenizer_decodes_through_its_rust_tokenizer(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[list[int]] = []
    original = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: calls.append(ids) or original(ids))
    assert text_decoder(tokenizer)([1, 2, 3]) == original([1, 2, 3], skip_special_tokens=True)
    assert calls == []  # HF's Python wrapper was not on the way


def test_direct_decode_equals_the_tokenizers_decode(tokenizer: Any) -> None:
    decode = text_decoder(tokenizer)
    rng = random.Random(0)
    vocab = len(tokenizer)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for _ in range(50):
            start = rng.randrange(len(ids))
            piece = ids[start : start + rng.randrange(1, 8)]
            assert decode(piece) == hf_decode(tokenizer, piece)
    for _ in range(200):  # any ids at all, special ones included
        piece = [rng.randrange(vocab) for _ in range(rng.randrange(1, 6))]
        assert decode(piece) == hf_decode(tokenizer, piece)


def test_a_tokenizer_that_cleans_up_spaces_keeps_its_own_decode(tokenizer: Any) -> None:
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    calls: list[list[int]] = []
    original = cleaning.decode
    cleaning.decode = lambda ids, **kw: calls.append(ids) or original(ids, **kw)
    assert text_decoder(cleaning)([42, 43]) == original([42, 43], skip_special_tokens=True)
    assert calls == [[42, 43]]


def test_a_tokenizer_without_a_rust_backend_keeps_its_own_decode() -> None:
    class Plain:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            assert skip_special_tokens
            return "|".join(map(str, ids))

    assert text_decoder(Plain())([1, 2]) == "1|2"


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_adds_up_to_the_whole_decode(tokenizer: Any, text: str) -> None:
    prompt = tokenizer.encode("Say something:")
    output = tokenizer.encode(text)
    for decode in (text_decoder(tokenizer), lambda ids: hf_decode(tokenizer, ids)):
        detok = IncrementalDetokenizer(decode, prompt)
        pieces = [detok.append(token) for token in output]
        assert "".join(pieces) == hf_decode(tokenizer, output)
        assert not any("\ufffd" in piece for piece in pieces)  # no half characters on the way
