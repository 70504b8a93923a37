"""The model-fetch init container: downloads an hf:// model into the model-cache volume.

    python -m kvpilot.operator.modelfetch --repo org/name [--revision R] --dest DIR
        [--allow-pattern GLOB ...] [--cache-dir CACHE]

With --cache-dir (the engine's KVPILOT_CACHE_DIR on the same volume), a GGUF model is converted
there too (`kvpilot prepare`), once for every pod that shares the volume: the engine then loads
the converted weights instead of converting before it serves.

Idempotent: files already complete in DIR are not fetched again (a cache claim survives pods), and
a model already converted is not converted again.
On failure the reason goes to the termination log, which the operator shows in the
InferenceService's Degraded condition (reason ModelDownloadFailed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

TERMINATION_LOG = "/dev/termination-log"
# What a servable model directory contains: an HF config, or a GGUF file.
MODEL_MARKERS = ("config.json", "*.gguf")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvpilot.operator.modelfetch")
    parser.add_argument("--repo", required=True, help="Hugging Face repo id, org/name")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument("--dest", required=True, type=Path, help="directory to download into")
    parser.add_argument(
        "--allow-pattern",
        action="append",
        dest="allow_patterns",
        default=None,
        help="glob of files to fetch (repeatable; default: all files)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="convert a GGUF model into this engine cache (default: no conversion)",
    )
    parser.add_argument("--termination-log", type=Path, default=Path(TERMINATION_LOG))
    return parser


def fetch(repo: str, revision: str | None, dest: Path, allow_patterns: list[str] | None) -> None:
    """Downloads into dest; raises RuntimeError with an actionable message."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    token = os.environ.get("HF_TOKEN") or None
    try:
        snapshot_download(
            repo,
            revision=revision,
            local_dir=dest,
            allow_patterns=allow_patterns,
            token=token,
            # Read at call time: huggingface_hub reads HF_ENDPOINT once, at import.
            endpoint=os.environ.get("HF_ENDPOINT") or None,
        )
    except GatedRepoError as error:
        raise RuntimeError(
            f"{repo} is gated: accept its terms on the Hub with your account, then name a "
            f"Secret holding that account's token in spec.model.tokenSecret ({_first_line(error)})"
        ) from error
    except RevisionNotFoundError as error:
        raise RuntimeError(f"{repo} has no revision {revision!r}") from error
    except RepositoryNotFoundError as error:
        hint = "" if token else " (if it is private, set spec.model.tokenSecret)"
        raise RuntimeError(f"{repo} was not found on the Hub{hint}") from error
    except (HfHubHTTPError, OSError) as error:
        raise RuntimeError(f"downloading {repo} failed: {_first_line(error)}") from error
    if not any(any(dest.rglob(marker)) for marker in MODEL_MARKERS):
        patterns = ", ".join(allow_patterns or ["*"])
        raise RuntimeError(
            f"{repo}: no config.json or *.gguf among the files matching allowPatterns "
            f"({patterns}); check spec.model.allowPatterns"
        )


def convert(dest: Path, cache_dir: Path) -> Path | None:
    """Converts the downloaded GGUF model into the engine's cache (None: an HF directory, nothing
    to convert); raises RuntimeError with the reason."""
    # Imported here: the engine (torch, gguf) is only paid for by a pod that converts.
    from kvpilot.engine.model.gguf_convert import ModelFileError
    from kvpilot.engine.prepare import convert_model

    try:
        return convert_model(str(dest), cache_dir)
    except ModelFileError as error:
        raise RuntimeError(f"converting the downloaded model failed: {error}") from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    print(f"fetching {args.repo}@{args.revision or 'main'} into {args.dest}", flush=True)
    try:
        fetch(args.repo, args.revision, args.dest, args.allow_patterns)
        if args.cache_dir is not None:
            converted = convert(args.dest, args.cache_dir)
            if converted is not None:
                print(f"converted {args.repo} into {converted}", flush=True)
    except Exception as error:  # whatever it is, the pod's status must say it
        message = str(error) if isinstance(error, RuntimeError) else f"unexpected error: {error!r}"
        print(f"model fetch failed: {message}", file=sys.stderr, flush=True)
        # Outside a pod there may be no termination log; stderr has the message anyway.
        with contextlib.suppress(OSError):
            args.termination_log.write_text(message)
        return 1
    print(f"fetched {args.repo} into {args.dest}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
