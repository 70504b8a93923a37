"""spec.model.uri: where the weights come from, and where the engine finds them inside its pod.

hf://org/name[@revision]         downloaded by an init container into the model-cache volume
pvc://claim[/path]               the claim is mounted as the model-cache volume
file:///path                     a path inside the image
builtin://NAME                   a model bundled with the engine (operator/builtin_models.py)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpilot.operator.builtin_models import BUILTIN_MODELS
from kvpilot.operator.constants import MODEL_CACHE_MOUNT

# One RE2-compatible pattern (the API server's regex dialect) for the CRD schema, so that
# `kubectl apply` rejects an unknown scheme before the operator ever sees it.
HF_PART = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"
REVISION = r"[A-Za-z0-9._/-]{1,255}"
DNS_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
URI_PATTERN = (
    rf"^(hf://{HF_PART}/{HF_PART}(@{REVISION})?"
    rf"|pvc://{DNS_LABEL}(/[^\s]*)?"
    r"|file:///[^\s]+"
    rf"|builtin://({'|'.join(name.replace('.', '[.]') for name in BUILTIN_MODELS)}))$"
)


# An adapter comes from the same places as a model, bar builtin:// (no adapter is bundled).
ADAPTER_URI_PATTERN = (
    rf"^(hf://{HF_PART}/{HF_PART}(@{REVISION})?"
    rf"|pvc://{DNS_LABEL}(/[^\s]*)?"
    r"|file:///[^\s]+)$"
)


_ACCEPTED = (
    "use hf://org/name[@revision], pvc://claim/path, file:///path or "
    f"builtin://{next(iter(BUILTIN_MODELS))}"
)


@dataclass(frozen=True)
class HfModel:
    repo: str  # "org/name"
    revision: str | None

    @property
    def local_dir(self) -> str:
        # One directory per revision, so a shared cache claim can hold several side by side.
        revision = (self.revision or "main").replace("/", "--")
        return f"{MODEL_CACHE_MOUNT}/hf/{self.repo}/{revision}"


@dataclass(frozen=True)
class PvcModel:
    claim: str
    path: str  # inside the claim, without a leading slash; "" is the claim's root

    @property
    def local_dir(self) -> str:
        return f"{MODEL_CACHE_MOUNT}/{self.path}".rstrip("/")


@dataclass(frozen=True)
class FileModel:
    path: str

    @property
    def local_dir(self) -> str:
        return self.path


@dataclass(frozen=True)
class BuiltinModel:
    name: str

    @property
    def local_dir(self) -> None:
        return None


ModelSource = HfModel | PvcModel | FileModel | BuiltinModel


def parse_model_uri(uri: str) -> ModelSource:
    """Parses spec.model.uri; raises ValueError naming what is wrong and what is accepted."""
    scheme, sep, rest = uri.partition("://")
    if not sep:
        raise ValueError(f"model uri {uri!r} has no scheme: {_ACCEPTED}")
    if scheme == "hf":
        return _parse_hf(uri, rest)
    if scheme == "pvc":
        claim, _, path = rest.partition("/")
        if not re.fullmatch(DNS_LABEL, claim):
            raise ValueError(
                f"model uri {uri!r}: {claim!r} is not a valid PersistentVolumeClaim name"
                " (lowercase letters, digits and '-', at most 63 characters)"
            )
        path = path.strip("/")
        if ".." in path.split("/"):
            raise ValueError(f"model uri {uri!r}: '..' may not appear in the path")
        if re.search(r"\s", path):
            raise ValueError(f"model uri {uri!r}: the path may not contain whitespace")
        return PvcModel(claim=claim, path=path)
    if scheme == "file":
        if not rest.startswith("/") or rest == "/" or re.search(r"\s", rest):
            raise ValueError(
                f"model uri {uri!r}: file:// needs an absolute path without spaces, e.g."
                " file:///models/llama"
            )
        return FileModel(path=rest)
    if scheme == "builtin":
        if rest not in BUILTIN_MODELS:
            raise ValueError(
                f"model uri {uri!r}: unknown builtin model {rest!r} (builtin models:"
                f" {', '.join(BUILTIN_MODELS)})"
            )
        return BuiltinModel(name=rest)
    raise ValueError(f"model uri {uri!r} has the unknown scheme {scheme!r}: {_ACCEPTED}")


def parse_adapter_uri(uri: str) -> HfModel | PvcModel | FileModel:
    """Parses spec.adapters[].uri: a model URI of any scheme but builtin://."""
    source = parse_model_uri(uri)
    if isinstance(source, BuiltinModel):
        raise ValueError(
            f"adapter uri {uri!r}: no adapter is bundled with the engine: use "
            "hf://org/name[@revision], pvc://claim/path or file:///path"
        )
    return source


def _parse_hf(uri: str, rest: str) -> HfModel:
    repo, at, revision = rest.partition("@")
    parts = repo.split("/")
    if len(parts) != 2 or not all(re.fullmatch(HF_PART, part) for part in parts):
        raise ValueError(
            f"model uri {uri!r}: expected hf://org/name[@revision] with a Hugging Face repo id"
            " such as hf://Qwen/Qwen2.5-0.5B-Instruct"
        )
    if at and not re.fullmatch(REVISION, revision):
        raise ValueError(
            f"model uri {uri!r}: {revision!r} is not a valid revision (a branch, tag or commit)"
        )
    if ".." in repo or (at and ".." in revision.split("/")):
        raise ValueError(f"model uri {uri!r}: '..' may not appear in a repo id or revision")
    return HfModel(repo=repo, revision=revision if at else None)
