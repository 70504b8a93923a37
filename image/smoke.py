"""The image's smoke test, run by its build (as the user the pods run as) and runnable in the
image: `python /opt/kvpilot/smoke.py`. Exits non-zero, naming the check, when one fails.

Checks that every command's entry point imports, that the bundled model is there, that the CPU
kernels load (in the CPU variant on an x86 CPU with AVX2: the prebuilt ones, as it has no
compiler), that the bundled model generates a few tokens on the CPU, and that the CPU variant
carries no Triton. Writes only under a temporary folder, removed after."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import tempfile

ENTRY_POINTS = (
    "kvpilot.cli",
    "kvpilot.engine.generate_cli",
    "kvpilot.engine.server.cli",
    "kvpilot.operator.cli",
    "kvpilot.operator.modelfetch",
    "kvpilot.router.cli",
)


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"smoke test failed: {what}")
    print(f"ok: {what}")


def main() -> None:
    variant = os.environ.get("KVPILOT_IMAGE_VARIANT", "cpu")
    has_triton = importlib.util.find_spec("triton") is not None
    check(has_triton == (variant != "cpu"), f"triton installed only in a GPU variant ({variant})")
    for name in ENTRY_POINTS:
        importlib.import_module(name)
    check(True, "every command's entry point imports")
    with tempfile.TemporaryDirectory() as scratch:
        # The pods' layout: the engine's derived files under KVPILOT_CACHE_DIR, HOME writable.
        os.environ["KVPILOT_CACHE_DIR"] = os.path.join(scratch, "cache")
        os.environ["HOME"] = scratch
        os.environ["HF_HUB_OFFLINE"] = "1"
        from kvpilot.engine import LLM, SamplingParams
        from kvpilot.engine.cpu.build import (
            ISAS,
            cpu_flags,
            find_prebuilt,
            load_library,
            prebuilt_dir,
        )
        from kvpilot.engine.model.loader import bundled_gguf_path

        check(bundled_gguf_path().is_file(), f"the bundled model is at {bundled_gguf_path()}")
        prebuilt = find_prebuilt(prebuilt_dir(), cpu_flags())
        if variant == "cpu" and ISAS[-1].cpu_flags <= cpu_flags():
            check(prebuilt is not None, f"the CPU kernels are prebuilt for this CPU ({prebuilt})")
        check(load_library() is not None, "the CPU kernels load (prebuilt, or compiled)")
        llm = LLM()
        outputs = llm.chat(
            [[{"role": "user", "content": "What is the capital of France?"}]],
            SamplingParams(temperature=0.0, max_tokens=8),
        )
        text = outputs[0].outputs[0].text
        check(bool(text.strip()), f"the bundled model answers on the CPU: {text!r}")


if __name__ == "__main__":
    main()
