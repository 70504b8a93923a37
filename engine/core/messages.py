"""What crosses between the API process and the engine-core process: token ids and numbers, never
text. msgspec structs, encoded as msgpack arrays (compact, no field names on the wire).

API -> core: AddRequest, Abort, ResetPrefixCache, LoadLoRA, UnloadLoRA, Shutdown (one tagged
union, `Command`).
Core -> API: CoreReady or CoreFailed once at start, then one StepOutputs per step (or per batch of
commands applied between steps, so the API side sees the queue move), and a LoRAReply per LoadLoRA
or UnloadLoRA (`CoreEvent`).
"""

from __future__ import annotations

import msgspec

from kvpilot.contract.kv_events import KvDelta
from kvpilot.engine.sampling_params import SamplingParams

# (sampled token's logprob, its rank, top-N [(token, logprob)]) of the raw distribution.
SampledLogprobs = tuple[float, int, list[tuple[int, float]]]


class EngineStats(msgspec.Struct, frozen=True, array_like=True):
    """Scheduler state and cumulative counters after a step."""

    num_waiting: int
    num_running: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    # LoRA adapters of the running and the waiting requests, and those in the device's slots.
    running_loras: list[str] = []
    waiting_loras: list[str] = []
    resident_loras: list[str] = []
    # Speculative decoding, cumulative (engine/spec_decode/policy.SpecDecodeCounters).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []


class AddRequest(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # The API side knows the tokenizer's EOS; the core knows no tokenizer.
    eos_token_ids: tuple[int, ...]
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_name: str | None = None  # a registered adapter (None: the base model)
    priority: int = 0  # lower is served first (the priority policy only)
    # Leading prompt tokens whose full blocks are cached without cache_salt (shared by all).
    shared_prefix_tokens: int = 0
    # A better priority to guard against while this request is here (None: none declared).
    guard_priority: int | None = None


class Abort(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Stop a request (index None: all its sequences), e.g. a disconnect, or one sequence whose
    text hit a stop string on the API side."""

    request_id: str
    index: int | None = None


class ResetPrefixCache(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class LoadLoRA(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Read the adapter at `path` and register it as `name` (answered by a LoRAReply)."""

    command_id: str
    name: str
    path: str
    replace: bool = False


class UnloadLoRA(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Forget adapter `name` (answered by a LoRAReply; refused while requests use it)."""

    command_id: str
    name: str


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


Command = AddRequest | Abort | ResetPrefixCache | LoadLoRA | UnloadLoRA | Shutdown


class SeqUpdate(msgspec.Struct, array_like=True, gc=False):
    """One sequence's token from one step."""

    request_id: str
    index: int
    token_id: int
    logprobs: SampledLogprobs | None = None
    # Decided on token ids: "stop" (EOS or a stop token id) or "length".
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Speculation in the step that gave this token: the proposals verified and how many were
    # accepted (on a step's first token of the sequence; 0 on the others and without proposals).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class StepOutputs(msgspec.Struct, array_like=True, tag=True, gc=False):
    updates: list[SeqUpdate]
    stats: EngineStats
    # Commands applied so far (the API side counts adds it sent beyond this as still waiting).
    num_commands_applied: int
    # Requests scheduled for the first time this step, at `scheduled_time` (time.monotonic, which
    # is one clock for every process of the machine).
    first_scheduled: list[str] = []
    scheduled_time: float = 0.0
    token_time: float = 0.0
    step_duration: float | None = None
    # Adds the core refused (request id, why): the API side validates first, so a server fault.
    rejected: list[tuple[str, str]] = []
    # How the set of cached block hashes changed (None: not at all); see kvpilot.contract.kv_events.
    kv_events: KvDelta | None = None


class ModelDescription(msgspec.Struct, frozen=True, array_like=True):
    """What the API side needs to know about the loaded model."""

    model_name: str
    hf_dir: str  # where its tokenizer and config.json are
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    enable_prefix_caching: bool
    eos_token_ids: tuple[int, ...]  # from the model's config (the tokenizer may add one)
    tensor_parallel_size: int = 1
    grammar_backend: str = "xgrammar"  # what constrained requests are compiled with
    async_scheduling: bool = False  # steps launched before the previous one's tokens are read
    max_loras: int = 0  # adapter slots (0: adapters off)
    max_lora_rank: int = 0
    lora_modules: list[tuple[str, str]] = []  # (name, path) of the adapters loaded at start
    max_num_seqs: int = 0  # sequences a step runs at most
    scheduling_policy: str = "fcfs"  # engine.config.SCHEDULING_POLICIES
    cache_dtype: str = "auto"  # the KV cache's --kv-cache-dtype (contract KV_CACHE_DTYPES)
    num_speculative_tokens: int = 0  # proposals per step at most (0: no speculation)


class ModelFilesFound(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Sent once the model's files are found (a GGUF converted), before its weights load: the API
    process loads the tokenizer from hf_dir meanwhile, not after CoreReady."""

    hf_dir: str


class CoreReady(msgspec.Struct, frozen=True, array_like=True, tag=True):
    model: ModelDescription


class CoreFailed(msgspec.Struct, frozen=True, array_like=True, tag=True):
    message: str
    during_load: bool


class LoRAReply(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """The answer to a LoadLoRA or UnloadLoRA: an HTTP status (contract/lora.py) and message."""

    command_id: str
    status: int
    message: str


CoreEvent = StepOutputs | ModelFilesFound | CoreReady | CoreFailed | LoRAReply
