"""A model's first N decoder layers as a model of its own: a draft of the same tokenizer at a
fraction of the cost, with no training (what it proposes is what the first layers, read straight
out through the final norm and head, guess). An HF directory in, an HF directory out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from kvpilot.engine.model.files import ModelFileError

LAYER_PREFIX = "model.layers."


def cut_layers(source: Path, num_layers: int, out: Path) -> Path:
    """Writes source's first num_layers layers (its embeddings, final norm and head kept) as a
    model in out, a new directory; its tokenizer and other files are copied."""
    config = json.loads((source / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ModelFileError(
            f"{source}: cannot keep {num_layers} of its {config['num_hidden_layers']} layers"
        )
    out.mkdir(parents=True)
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {}
    for file in sorted(source.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                layer = name[len(LAYER_PREFIX) :].split(".")[0]
                if not name.startswith(LAYER_PREFIX) or int(layer) < num_layers:
                    kept[name] = f.get_tensor(name)
    save_file(kept, str(out / "model.safetensors"))
    for file in source.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy2(file, out / file.name)
    return out
