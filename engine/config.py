"""Typed configuration of the engine: the model's shape, the KV cache, the scheduler, the engine."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvpilot.contract.engine_choices import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUTS_BACKENDS,
)
from kvpilot.contract.engine_defaults import (
    AUTO_DTYPE,
    DEFAULT_GUARD_STEP_SEQS,
    DEFAULT_GUARD_STEP_TOKENS,
    DEFAULT_GUARD_WINDOW_S,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SCHEDULING_POLICY,
)
from kvpilot.contract.lora import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    MAX_LORA_RANK_LIMIT,
    name_problem,
)
from kvpilot.contract.sizing import kv_bytes_per_token

# The engine's log lines (server, engine core, prepare); bench/serve_startup.py reads their times.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

if TYPE_CHECKING:
    import torch

# Torch is imported only where a device or dtype is resolved: the value checks here are torch-free,
# so that `kvpilot serve`'s flags are checked by them in the operator too
# (engine/server/from_flags.py).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")


DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
SEED_MIN, SEED_END = -(2**63), 2**64


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style ('llama3') frequency scaling; 'default' means none."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self) -> None:
        if self.rope_type not in ("default", "llama3"):
            raise ValueError(f"rope_scaling.rope_type {self.rope_type!r} is not supported")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder, read from an HF config.json (or GGUF metadata)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        scaling = RopeScaling()
        if rope_type == "llama3":
            scaling = RopeScaling(
                rope_type="llama3",
                factor=float(rope["factor"]),
                low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            # Qwen2 configs often say tie_word_embeddings=false; Llama's default is false too.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            rope_scaling=scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V per token over all layers, at 1 byte per element (multiply by
        itemsize)."""
        return kv_bytes_per_token(
            num_layers=self.num_hidden_layers,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            itemsize=1,
        )

    @property
    def num_params(self) -> int:
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
        return (
            self.num_hidden_layers * per_layer + v * h * (1 if self.tie_word_embeddings else 2) + h
        )


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # one of BLOCK_SIZES
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    enable_prefix_caching: bool = True
    kv_cache_gib: float = DEFAULT_KV_CACHE_GIB  # the budget on CPU
    gpu_memory_utilization: float = (
        0.9  # the fraction of GPU memory the engine may take, KV included
    )
    # An explicit KV budget in bytes on any device (CPU or GPU): overrides kv_cache_gib and the
    # budget gpu_memory_utilization leaves (what a container's memory limit is sized against).
    kv_cache_bytes: int | None = None
    num_blocks: int | None = None  # overrides every budget (tests force tiny pools this way)

    def __post_init__(self) -> None:
        if self.block_size not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be one of {', '.join(map(str, BLOCK_SIZES))}, got "
                f"{self.block_size}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if not 0 < self.kv_cache_gib < math.inf:
            raise ValueError(f"kv_cache_gib must be > 0 and finite, got {self.kv_cache_gib}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError(f"kv_cache_bytes must be >= 1, got {self.kv_cache_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # the per-step token budget
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    # fcfs: arrival order; priority: by each request's priority (lower first), then arrival.
    policy: str = DEFAULT_SCHEDULING_POLICY
    # Under priority: for this long after a rank last had a request here, the ranks worse than
    # it get at most guard_step_seqs sequences and guard_step_tokens tokens of each step (their
    # decodes and prefill chunks together), so a better request never waits long for the step
    # it arrives into. 0: no guard.
    guard_window_s: float = DEFAULT_GUARD_WINDOW_S
    guard_step_seqs: int = DEFAULT_GUARD_STEP_SEQS
    guard_step_tokens: int = DEFAULT_GUARD_STEP_TOKENS
    # Under priority: a step with a better rank's prefill in it holds no worse work (False: worse
    # work fills what the budget leaves, more throughput for it, a longer first token for the
    # better one).
    isolate_prefills: bool = True

    def __post_init__(self) -> None:
        if self.guard_window_s < 0:
            raise ValueError(f"guard_window_s must be >= 0, got {self.guard_window_s:g}")
        if self.guard_step_seqs < 1:
            raise ValueError(f"guard_step_seqs must be >= 1, got {self.guard_step_seqs}")
        if self.guard_step_tokens < 1:
            raise ValueError(f"guard_step_tokens must be >= 1, got {self.guard_step_tokens}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, got "
                f"{self.policy!r}"
            )
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


SPECULATIVE_METHODS = ("ngram", "draft_model")
# A "model" that names the n-gram method rather than a draft (vLLM's spellings).
NGRAM_MODEL_NAMES = ("ngram", "[ngram]")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config`, vLLM's JSON keys): proposals from the
    sequence's own tokens (n-gram / prompt lookup, engine/spec_decode/ngram.py) or from a smaller
    draft model of the same vocabulary (engine/spec_decode/draft_model.py), verified in one
    target forward per step. When it backs off is decided in one place:
    engine/spec_decode/policy.py (disable_by_batch_size, min_acceptance).

    As vLLM's: without a method, a "model" other than "ngram" makes it draft_model (no model:
    ngram)."""

    method: str | None = None  # None: inferred from model (see above)
    # The draft model (draft_model): an HF directory, a .gguf, or builtin://NAME.
    model: str | None = None
    num_speculative_tokens: int = 4  # proposals per sequence per step, at most
    # The longest and shortest suffix of the sequence looked up earlier in it (longest first).
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # No proposals while more sequences than this run (verifying k extra tokens per sequence
    # costs compute a large batch no longer has spare). vLLM's key.
    disable_by_batch_size: int = 8
    # No proposals for a sequence while its measured share of accepted proposals is below this
    # (probed now and then to measure it again; engine/spec_decode/policy.py).
    min_acceptance: float = 0.2

    def __post_init__(self) -> None:
        if self.method is None:
            draft = self.model is not None and self.model not in NGRAM_MODEL_NAMES
            object.__setattr__(self, "method", "draft_model" if draft else "ngram")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                f"{self.method!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ValueError(f"speculative model must be a non-empty string, got {self.model!r}")
        if self.method == "draft_model" and self.model is None:
            raise ValueError(
                'speculative method draft_model needs a "model": the draft\'s directory, .gguf '
                "or builtin://NAME"
            )
        if self.method == "ngram" and self.model not in (None, *NGRAM_MODEL_NAMES):
            raise ValueError(
                f"speculative method ngram takes no draft model, got model {self.model!r} "
                '(a draft model is method "draft_model")'
            )
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative {name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        size = self.disable_by_batch_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"speculative disable_by_batch_size must be an integer >= 1, got {size!r}"
            )
        share = self.min_acceptance
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 <= share <= 1:
            raise ValueError(f"speculative min_acceptance must be in [0, 1], got {share!r}")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """`--speculative-config`'s value: a JSON object of this class's fields (ValueError,
        naming the problem, for anything else)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not valid JSON: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative config must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative config has unknown keys {unknown}; known: {sorted(known)}"
            )
        return cls(**value)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (contract/lora.py): how many a step may use (device slots), how large their
    rank may be, how many stay read in host memory, the adapters loaded at start, and whether the
    runtime load/unload API is on."""

    max_loras: int = DEFAULT_MAX_LORAS
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    max_cpu_loras: int | None = None  # None: max_loras
    modules: tuple[tuple[str, str], ...] = ()  # (name, path) loaded at start
    allow_runtime_updating: bool = False

    @property
    def resolved_max_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK_LIMIT:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK_LIMIT}], got {self.max_lora_rank}"
            )
        if self.resolved_max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )
        names = [name for name, _ in self.modules]
        for name in names:
            problem = name_problem(name)
            if problem:
                raise ValueError(problem)
        if len(set(names)) != len(names):
            raise ValueError("lora modules must have distinct names")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the bundled SmolLM2
    load_format: str = "auto"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"
    attention_backend: str = "auto"  # auto: "cpu" on CPU, "triton" on CUDA ("torch" without it)
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    seed: int = 0
    served_model_name: str | None = None
    # Ranks the model is split over (one process each; one GPU each on CUDA).
    tensor_parallel_size: int = 1
    # How long a collective may wait for the other ranks before the engine fails (a dead rank).
    distributed_timeout_s: float = 120.0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Grammar library for constrained decoding ("auto": xgrammar).
    structured_outputs_backend: str = "auto"
    # Grammar masks of a step filled on a thread while its forward runs (False: after it).
    overlap_grammar_masks: bool = True
    # On CPU, keep the heap memory a step frees for the next step (engine/cpu/heap.py).
    retain_freed_memory: bool = True
    # On CUDA (with the triton backend, one rank), decode steps replay CUDA graphs captured at
    # start (engine/cuda_graphs.py); True runs every step eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Schedule step N+1 and launch it before reading step N's sampled tokens, so the host's work
    # runs while the device computes (vLLM's async scheduling). None: on for one CUDA rank, off
    # on CPU (where the forward runs on the host anyway, and it would only delay outputs a step).
    async_scheduling: bool | None = None
    # LoRA adapters (--enable-lora); None: off, and the model has no adapter path at all.
    lora: LoRAConfig | None = None
    # Speculative decoding (--speculative-config); None: off.
    speculative: SpeculativeConfig | None = None

    @property
    def resolved_async_scheduling(self) -> bool:
        wanted = self.async_scheduling
        if wanted is None:
            wanted = self.resolved_device.type == "cuda"
        # Speculation needs a step's accepted tokens on the host before it can propose and
        # schedule the next one: its steps run in turn (no overlap).
        return wanted and self.tensor_parallel_size == 1 and self.speculative is None

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto or one of {DTYPE_NAMES}, got {self.dtype!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got "
                f"{self.attention_backend!r}"
            )
        if self.structured_outputs_backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(
                f"structured_outputs_backend must be one of {STRUCTURED_OUTPUTS_BACKENDS}, got "
                f"{self.structured_outputs_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0 < self.distributed_timeout_s < math.inf:
            raise ValueError(
                f"distributed_timeout_s must be > 0 and finite, got {self.distributed_timeout_s}"
            )
        spec = self.speculative
        if spec is not None and spec.method == "draft_model" and self.tensor_parallel_size != 1:
            raise ValueError(
                "speculative method draft_model runs with tensor_parallel_size 1 only, got "
                f"{self.tensor_parallel_size}"
            )
        if self.speculative is not None and self.async_scheduling:
            raise ValueError(
                "async scheduling does not run with speculative decoding (a step's accepted "
                "tokens are needed on the host to schedule the next)"
            )
        if not SEED_MIN <= self.seed < SEED_END:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed must be in [-2**63, 2**64), got {self.seed}")

    def device_type(self, num_gpus: int) -> str:
        """The device type this config runs on ("cuda" or "cpu") with `num_gpus` GPUs visible."""
        if self.device == "auto":
            return "cuda" if num_gpus else "cpu"
        return self.device.partition(":")[0]

    def check_placement(self, num_gpus: int) -> None:
        """ValueError, with the numbers, where this config cannot run with `num_gpus` visible
        GPUs. Torch-free: `kvpilot serve` checks its machine with it, the operator a pod with
        spec.gpus."""
        device_type = self.device_type(num_gpus)
        check_dtype_on(self.dtype, device_type)
        if device_type != "cuda":
            return
        first = int(self.device.partition(":")[2] or 0)
        if not num_gpus:
            raise ValueError(f"device {self.device} needs a GPU, but none is visible: use cpu")
        if first >= num_gpus:
            raise ValueError(f"device {self.device} needs GPU {first}, but {num_gpus} are visible")
        try:  # the ranks take one GPU each, from the device's on
            check_gpus_for_ranks(self.tensor_parallel_size, num_gpus - first)
        except ValueError as error:
            raise ValueError(f"{error} from {self.device} on" if first else str(error)) from None

    @property
    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def rank_device(self, rank: int) -> torch.device:
        """The device of tensor-parallel rank `rank`: cuda:rank on GPUs (counting from the
        configured index), the CPU otherwise."""
        import torch

        device = self.resolved_device
        if device.type != "cuda" or self.tensor_parallel_size == 1:
            return device
        return torch.device("cuda", (device.index or 0) + rank)

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        if self.resolved_device.type == "cpu":
            return "cpu"
        # On CUDA the Triton kernels, with decode steps as CUDA graphs: on an H200 (8B shape,
        # bench/RESULTS.md) 2.2x the torch reference's throughput eagerly, 6.5x with the graphs.
        return "triton" if importlib.util.find_spec("triton") is not None else "torch"

    @property
    def resolved_dtype(self) -> torch.dtype:
        import torch

        device = self.resolved_device
        name = AUTO_DTYPE[device.type] if self.dtype == "auto" else self.dtype
        check_dtype_on(name, device.type)
        dtype: torch.dtype = getattr(torch, name)
        return dtype


def check_dtype_on(dtype: str, device_type: str) -> None:
    if device_type == "cpu" and dtype == "float16":
        raise ValueError("dtype float16 is not supported on CPU: use float32 or bfloat16")


def check_gpus_for_ranks(tensor_parallel_size: int, num_gpus: int | None) -> None:
    """ValueError unless each rank has a GPU of its own (num_gpus None: on CPU, where the ranks
    share the cores)."""
    if num_gpus is not None and tensor_parallel_size > num_gpus:
        raise ValueError(
            f"tensor_parallel_size {tensor_parallel_size} needs {tensor_parallel_size} GPUs, "
            f"but {num_gpus} are visible"
        )
