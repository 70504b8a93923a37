"""The characters one token may stand for (the prompt length check before tokenizing), read from
the Rust tokenizer's decode: a bound on what the tokenizer's own decode gives every token."""

from __future__ import annotations

from kvpilot.engine.model.files import load_tokenizer
from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
from kvpilot.engine.model.loader import bundled_gguf_path
from kvpilot.engine.server.preprocess import max_chars_per_token


def test_the_bound_covers_every_token_as_the_tokenizer_decodes_it() -> None:
    tokenizer = load_tokenizer(gguf_to_hf_dir(bundled_gguf_path()))
    ids = [[i] for i in range(len(tokenizer))]
    longest = max(len(t) for t in tokenizer.batch_decode(ids, skip_special_tokens=False))
    bound = max_chars_per_token(tokenizer)
    # SmolLM2's tokenizer has no normalizer: the longest token, +1 for a dropped leading-space
    # marker, exactly as transformers' batch decode gives it.
    assert tokenizer.backend_tokenizer.normalizer is None
    assert bound == longest + 1, (longest, bound)
