"""What a model directory's files are, read without torch: the error for a bad model file and the
tokenizer side of a directory (the API process, its big-body worker and the router load
tokenizers, and none of them needs torch)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
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


def file_identity(path: Path) -> str:
    """What tells this version of a file from another without reading it: its resolved path,
    size, mtime and inode (a new file at the same path, or a rewrite, changes one of them)."""
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def eos_token_ids(model_eos: tuple[int, ...], tokenizer: Any) -> tuple[int, ...]:
    """The model config's EOS ids and the tokenizer's, if it names one."""
    ids = set(model_eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


@contextmanager
def torch_kept_out() -> Iterator[None]:
    """`import torch` fails in this process while this lasts, unless torch is imported already.
    Around the tokenizer's load in the processes that only tokenize (the API process before it is
    ready, its big-body worker): transformers then takes torch as absent and loads the same
    tokenizer class without importing it, about 2 s less of a start on 2 cores
    (bench/serve_startup.py). Lifted after: the first structured-output or tool request imports
    xgrammar, and torch with it. Only where transformers is first imported here and never asked
    for a model later (it decides at import what torch makes available). A None entry in
    sys.modules is Python's documented way to make an import fail."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


def set_offline_defaults() -> None:
    # Nothing is ever fetched from a model hub at run time.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
