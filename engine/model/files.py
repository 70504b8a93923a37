"""What a model directory's files are, read without torch: the error for a bad model file and the
tokenizer side of a directory (the API process, its big-body worker and the router load
tokenizers, and none of them needs torch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelFileError(ValueError):
    """A model file that is missing, unreadable or not what it claims to be."""


def has_tokenizer(hf_dir: Path) -> bool:
    return any((hf_dir / name).exists() for name in TOKENIZER_FILES)


def load_tokenizer(hf_dir: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(hf_dir))
    except Exception as exc:
        raise ModelFileError(f"{hf_dir}: no usable tokenizer ({exc})") from exc


def eos_token_ids(model_eos: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """The model config's EOS ids and the tokenizer's, if it names one."""
    ids = set(model_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def set_offline_defaults() -> None:
    # Nothing is ever fetched from a model hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
