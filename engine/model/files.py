"""What a model directory's files are, read without torch: the error for a bad model file and the
tokenizer side of a directory (the API process, its big-body worker and the router load
tokenizers, and none of them needs torch)."""

from __future__ import annotations

import os
import sys
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


def keep_torch_out() -> bool:
    """Make `import torch` fail in this process from here on, unless torch is already imported;
    whether it is kept out. For the processes that only tokenize (the API process, its big-body
    worker, the router): transformers then takes torch as absent and loads the same tokenizer
    class without importing it, about 2 s less of a start on 2 cores (bench/serve_startup.py)
    and torch's memory saved. A None entry in sys.modules is Python's documented way to make an
    import fail; spawned children (the engine core) start with their own modules."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is None
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True


def set_offline_defaults() -> None:
    # Nothing is ever fetched from a model hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
