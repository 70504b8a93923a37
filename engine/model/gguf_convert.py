"""GGUF -> an HF-style directory (config.json, model.safetensors, tokenizer files) in a local cache.

Dequantizing takes seconds and the tokenizer conversion more; both are done once per file
content, so a second start, another pod on a shared cache volume, or the same file under another
path loads the plain safetensors directory. The cache key is the SHA-256 of the GGUF's bytes,
computed once per (path, size, mtime, inode) and remembered in the cache; the directory is
published once under a lock (publish.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from kvpilot.engine.model.files import ModelFileError as ModelFileError
from kvpilot.engine.model.files import file_identity
from kvpilot.engine.model.publish import publish_once

log = logging.getLogger("kvpilot")

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
# Architectures whose converter permuted q/k rows into llama.cpp's interleaved rotary layout.
PERMUTED_QK = {"llama"}

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache" / "kvpilot"))


def content_digest(path: Path, root: Path | None = None) -> str:
    """SHA-256 of the file's bytes. Hashing ~100 MB-10 GB takes a while, so the digest is kept
    under a key of what identifies this version of the file cheaply (a new file at the same path,
    or a rewrite, changes size, mtime or inode: that key then misses and the bytes are hashed
    again; the same bytes give the same digest whatever the path)."""
    memo_name = hashlib.sha256(file_identity(path).encode()).hexdigest()[:32]
    memo = (root or cache_root()) / "gguf" / "digests" / memo_name
    with contextlib.suppress(OSError):
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            sha.update(chunk)
    digest = sha.hexdigest()
    with contextlib.suppress(OSError):  # a read-only cache only loses the memo
        memo.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
        tmp.write_text(digest)
        tmp.replace(memo)
    return digest


def gguf_cache_dir(gguf_path: Path, root: Path | None = None) -> Path:
    """Where gguf_path's conversion lies under the cache root (default: cache_root())."""
    root = root or cache_root()
    return root / "gguf" / f"sha256-{content_digest(gguf_path, root)[:32]}"


def is_converted(out_dir: Path) -> bool:
    return (out_dir / "model.safetensors").exists() and (out_dir / "config.json").exists()


def hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ModelFileError(f"unexpected tensor {gguf_name!r} in GGUF file")


def unpermute_qk(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary pairs, back to HF's rotate-half layout."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config_from_gguf(reader: Any) -> dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(f"GGUF architecture {arch!r} is not supported (llama, qwen2)")
    names = {t.name for t in reader.tensors}
    num_heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM"],
        "model_type": GGUF_ARCHITECTURES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": int(_field(reader, f"{arch}.rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return cfg


def _dequantize(tensor: Any) -> torch.Tensor:
    from gguf import quants

    data = quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dims innermost first
    return torch.from_numpy(np.array(data, dtype=np.float32, copy=True).reshape(shape))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Writes the HF-style directory for gguf_path into out_dir (an empty directory)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf_path))
    except Exception as exc:  # the gguf package raises assorted errors on a damaged file
        raise ModelFileError(f"{gguf_path}: not a readable GGUF file ({exc})") from exc
    cfg = hf_config_from_gguf(reader)
    permute = cfg["model_type"] in PERMUTED_QK
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(
        reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor", leave=False
    ):
        name = hf_name(t.name)
        w = _dequantize(t)
        if permute and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg["num_attention_heads"])
        elif permute and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg["num_key_value_heads"])
        tensors[name] = w.contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    log.info("converting the tokenizer of %s", gguf_path.name)
    from transformers import AutoTokenizer  # seconds to import: only once the weights are read

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "SOURCE").write_text(str(gguf_path.resolve()))


def gguf_to_hf_dir(gguf_path: str | os.PathLike[str], root: Path | None = None) -> Path:
    """The cached HF-style directory for a GGUF file under the cache root (default:
    cache_root()), converting it on first use."""
    path = Path(gguf_path)
    if not path.is_file():
        raise ModelFileError(f"model file not found: {path}")
    out = gguf_cache_dir(path, root)

    def build(tmp: Path) -> None:
        log.info("converting %s (dequantizing to float32; cached in %s)", path, out)
        convert_gguf(path, tmp)

    if not publish_once(out, build, is_converted):
        log.info("using the converted GGUF cached at %s", out)
    return out
