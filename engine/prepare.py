"""`kvpilot prepare`: does ahead of time what a replica would otherwise do before it serves.

    python -m kvpilot.engine.prepare [MODEL] [--cache-dir D] [--kernels-dir K [--isa NAME ...]]

MODEL (a .gguf file or a directory holding one; default: the bundled SmolLM2) is converted into
the model cache D (the engine's KVPILOT_CACHE_DIR: a pod's model-cache volume), where every
replica that reads that cache loads the converted safetensors. With --kernels-dir the CPU kernels
are compiled for each named instruction set into K (an image build ships them; the engine reads K
through KVPILOT_PREBUILT_KERNELS). A directory model with a config.json needs no conversion.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from kvpilot.engine.config import LOG_FORMAT
from kvpilot.engine.cpu.build import ISA_NAMES, build_prebuilt
from kvpilot.engine.model.gguf_convert import ModelFileError

log = logging.getLogger("kvpilot")


@dataclass(frozen=True)
class PrepareConfig:
    model: str | None  # a .gguf, a directory holding one, or None for the bundled model
    cache_dir: Path | None  # the model cache (None: the engine's default cache_root())
    kernels_dir: Path | None  # where prebuilt kernels go (None: none built)
    isas: tuple[str, ...]


def convert_model(model: str | None, cache_dir: Path) -> Path | None:
    """Converts the model's GGUF into cache_dir (once: a converted one is reused); returns the
    converted directory, or None when the model needs no conversion."""
    from kvpilot.engine.model.gguf_convert import gguf_to_hf_dir
    from kvpilot.engine.model.loader import gguf_of

    gguf = gguf_of(model)
    if gguf is None:
        return None
    return gguf_to_hf_dir(gguf, cache_dir)


def prepare(cfg: PrepareConfig) -> None:
    if cfg.kernels_dir is not None:
        for name, path in build_prebuilt(cfg.kernels_dir, cfg.isas).items():
            print(f"CPU kernels for {name}: {path}", flush=True)
    if cfg.cache_dir is not None or cfg.kernels_dir is None:
        from kvpilot.engine.model.gguf_convert import cache_root

        out = convert_model(cfg.model, cfg.cache_dir or cache_root())
        print(f"converted model: {out}" if out else "model needs no conversion", flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot prepare", description=__doc__.split("\n\n")[0].strip("`")
    )
    parser.add_argument("model", nargs="?", help="a .gguf or a directory (default: bundled)")
    parser.add_argument(
        "--cache-dir", type=Path, help="model cache to convert into (default: KVPILOT_CACHE_DIR)"
    )
    parser.add_argument(
        "--kernels-dir", type=Path, help="build the CPU kernels into this directory"
    )
    parser.add_argument(
        "--isa",
        action="append",
        choices=ISA_NAMES,
        help="instruction set to build the kernels for (repeatable; default: all of them)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    cfg = PrepareConfig(args.model, args.cache_dir, args.kernels_dir, tuple(args.isa or ISA_NAMES))
    try:
        prepare(cfg)
    except (ModelFileError, RuntimeError, ValueError) as exc:
        print(f"kvpilot prepare: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
