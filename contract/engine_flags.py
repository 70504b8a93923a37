"""`kvpilot serve`'s flags: the table they are defined by, the argument parser built from it, and
reading them without exiting.

The engine's command parses its command line with this parser; the operator reads
spec.engine.extraArgs with this very parser (and the engine's value rules,
kvpilot.engine.server.from_flags), so that an argument the engine would refuse at start is an
InvalidSpec, not a crash-looping pod.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvpilot.contract.cpus import parse_cpu_list
from kvpilot.contract.engine_choices import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_NAMES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    SCHEDULING_POLICIES,
    STRUCTURED_OUTPUTS_BACKENDS,
    TOOL_CALL_PARSERS,
)
from kvpilot.contract.engine_defaults import (
    DEFAULT_GUARD_STEP_SEQS,
    DEFAULT_GUARD_STEP_TOKENS,
    DEFAULT_GUARD_WINDOW_S,
    DEFAULT_KV_CACHE_GIB,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_SCHEDULING_POLICY,
)
from kvpilot.contract.help_format import DefaultsOnceFormatter
from kvpilot.contract.limits import RequestLimits
from kvpilot.contract.lora import (
    DEFAULT_MAX_LORA_RANK,
    DEFAULT_MAX_LORAS,
    RUNTIME_LORA_ENV,
    RUNTIME_LORA_FLAG,
)

API_KEY_ENV = "KVPILOT_API_KEY"


def non_empty(value: str) -> str:
    """An argparse type: an empty value is an error (an empty template renders no prompt)."""
    if not value:
        raise argparse.ArgumentTypeError("must not be empty")
    return value


def cpu_list(value: str) -> tuple[int, ...]:
    """An argparse type: a CPU list such as 0-3,6 (whether this machine has them is checked at
    start)."""
    try:
        return parse_cpu_list(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(value: str) -> int:
    """An argparse type: an integer >= 1."""
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def port_number(value: str) -> int:
    """An argparse type: a TCP port (uvicorn would fail to bind any other number, after the
    model started loading)."""
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


@dataclass(frozen=True)
class Flag:
    """One option: its names, the --help group it is listed in, argparse's keywords for it, and
    the set of options it excludes (None: it excludes none)."""

    group: str
    names: tuple[str, ...]
    options: Mapping[str, Any] = field(default_factory=dict)
    exclusive: str | None = None


def flag(group: str, *names: str, exclusive: str | None = None, **options: Any) -> Flag:
    return Flag(group, names, options, exclusive)


MODEL = "model"
HTTP = "HTTP"
ENGINE = "engine"
SCHEDULER = "scheduler"
KV_CACHE = "KV cache"
PARALLELISM = "parallelism"
REQUEST_LIMITS = "request limits"
SERVER = "server"
STRUCTURED = "structured outputs and tools"
LORA = "LoRA adapters"
# The --help sections, in the order they are listed.
GROUPS = (
    MODEL, HTTP, ENGINE, SCHEDULER, KV_CACHE, PARALLELISM, REQUEST_LIMITS, SERVER, STRUCTURED, LORA
)  # fmt: skip

_LIMITS = RequestLimits()  # the request limits' defaults

# Every option, in the order the usage line lists them.
FLAGS: tuple[Flag, ...] = (
    flag(MODEL, "--model", default=None,
         help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)"),
    flag(MODEL, "--served-model-name", default=None,
         help="the name clients pass as `model` (default: derived from the model)"),
    flag(HTTP, "--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every one)"),
    flag(HTTP, "--port", type=port_number, default=8000,
         help="0 picks a free port (logged at startup)"),
    flag(HTTP, "--api-key", default=None,
         help="require `Authorization: Bearer KEY` on /v1/*; visible to `ps`: prefer "
         f"--api-key-file or ${API_KEY_ENV} (default: none)"),
    flag(HTTP, "--api-key-file", default=None,
         help="read the API key from this file (a mounted Secret; default: none)"),
    flag(ENGINE, "--dtype", default="auto", choices=["auto", *DTYPE_NAMES],
         help="weights' and activations' dtype (auto: float32 on CPU, bfloat16 on GPU)"),
    flag(ENGINE, "--device", default="auto", help="auto, cpu, cuda or cuda:N"),
    flag(ENGINE, "--load-format", default="auto", choices=LOAD_FORMATS,
         help="how to read the weights (auto: from the model's files; dummy: random weights)"),
    flag(ENGINE, "--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
         help="attention kernels (auto: cpu, the C kernels, on CPU; torch on GPU)"),
    flag(ENGINE, "--enforce-eager", action="store_true",
         help="run every step eagerly: no CUDA graphs for decode and mixed steps (on CUDA they "
         "are captured at start for the triton attention backend)"),
    flag(ENGINE, "--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
         help="launch step N+1 before reading step N's tokens, overlapping host and device work "
         "(default: on for one CUDA rank, off on CPU)"),
    flag(ENGINE, "--speculative-config", type=non_empty, default=None,
         help="speculative decoding as vLLM's JSON, e.g. '{\"method\": \"ngram\", "
         "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
         "(default: off)"),
    flag(SCHEDULER, "--max-model-len", type=int, default=None,
         help="default: the model's context length"),
    flag(ENGINE, "--seed", type=int, default=0,
         help="the engine's seed (a request with `seed` is reproducible regardless)"),
    flag(KV_CACHE, "--block-size", type=int, default=16, choices=BLOCK_SIZES,
         help="tokens per KV-cache block"),
    flag(KV_CACHE, "--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
         help="the KV cache's element type: auto (the model's dtype) or 8-bit floats with "
         "per-head scales (fp8 = fp8_e4m3), which hold twice the tokens in the same budget"),
    flag(KV_CACHE, "--enable-prefix-caching", action=argparse.BooleanOptionalAction,
         default=True, help="reuse the KV blocks of prompts' shared prefixes"),
    flag(KV_CACHE, "--kv-cache-gib", type=float, default=DEFAULT_KV_CACHE_GIB,
         help="KV-cache budget on CPU"),
    flag(KV_CACHE, "--kv-cache-memory-bytes", type=int, default=None,
         help="KV-cache budget in bytes on CPU or GPU (overrides --kv-cache-gib and the budget "
         "--gpu-memory-utilization leaves; default: none)"),
    flag(KV_CACHE, "--gpu-memory-utilization", type=float, default=0.9,
         help="fraction of GPU memory the engine may use"),
    flag(KV_CACHE, "--num-gpu-blocks-override", type=int, default=None,
         help="exact number of KV blocks (overrides both budgets; default: none)"),
    flag(PARALLELISM, "--tensor-parallel-size", "-tp", type=int, default=1,
         help="split the model over this many ranks (processes; one GPU each on CUDA)"),
    flag(PARALLELISM, "--distributed-timeout", type=float, default=120.0,
         help="seconds a tensor-parallel collective waits for the other ranks before failing"),
    flag(PARALLELISM, "--engine-cpus", exclusive="cpus", type=cpu_list, default=None,
         metavar="LIST",
         help="bind the engine core (and its ranks) to these CPUs, e.g. 0-6, one intra-op "
         "thread each, and the API process to the others (default: both on every CPU)"),
    flag(PARALLELISM, "--api-cpus", exclusive="cpus", type=positive_int, default=None,
         metavar="N",
         help="leave N of this process's CPUs to the API process and bind the engine core to "
         "the rest (under a CPU quota alone: N fewer engine threads than the quota; default: "
         "none)"),
    flag(SCHEDULER, "--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
         help="sequences in the running batch"),
    flag(SCHEDULER, "--max-num-batched-tokens", type=int,
         default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
         help="tokens per engine step (longer prefills are chunked)"),
    flag(SCHEDULER, "--scheduling-policy", default=DEFAULT_SCHEDULING_POLICY,
         choices=SCHEDULING_POLICIES,
         help="fcfs: arrival order; priority: each request's `priority` (lower first), then "
         "arrival, preempting running requests of a worse priority"),
    flag(SCHEDULER, "--priority-guard-window", type=float, default=DEFAULT_GUARD_WINDOW_S,
         metavar="SECONDS",
         help="under priority: for this long after a better priority was last seen (or "
         "declared), worse ones share a bounded part of each step (0: no guard)"),
    flag(SCHEDULER, "--priority-guard-seqs", type=int, default=DEFAULT_GUARD_STEP_SEQS,
         help="under priority's guard: sequences of worse priority in one step"),
    flag(SCHEDULER, "--priority-guard-tokens", type=int, default=DEFAULT_GUARD_STEP_TOKENS,
         help="under priority's guard: tokens of worse priority in one step (what a better "
         "request arriving mid-step can find ahead of it)"),
    flag(REQUEST_LIMITS, "--max-queue", type=int, default=None,
         help="429 when this many requests wait (default: no limit)"),
    flag(REQUEST_LIMITS, "--retry-after", type=int, default=1,
         help="seconds a 429 tells clients to wait"),
    flag(REQUEST_LIMITS, "--max-request-body-bytes", type=int, default=_LIMITS.max_body_bytes,
         help="413 above this"),
    flag(REQUEST_LIMITS, "--max-json-depth", type=int, default=_LIMITS.max_json_depth,
         help="400 for a body nested deeper"),
    flag(REQUEST_LIMITS, "--max-sequences-per-request", type=int,
         default=_LIMITS.max_sequences, help="400 when prompts x n exceeds it"),
    flag(REQUEST_LIMITS, "--max-stop-strings", type=int, default=_LIMITS.max_stop,
         help="400 for more stop strings in a request"),
    flag(REQUEST_LIMITS, "--max-logit-bias", type=int, default=_LIMITS.max_logit_bias,
         help="400 for more logit_bias entries in a request"),
    flag(REQUEST_LIMITS, "--max-tokens-limit", type=int, default=_LIMITS.max_tokens,
         help="400 for a larger max_tokens; also caps an absent one (default: the context)"),
    flag(SERVER, "--shutdown-timeout", type=float, default=30.0,
         help="seconds in-flight requests get to finish after SIGTERM"),
    flag(SERVER, "--disable-vllm-metrics", action="store_true",
         help="expose only kvpilot:* metrics, not the vllm:* names"),
    flag(SERVER, "--disable-uvicorn-access-log", action="store_true",
         help="no log line per request (method, path, status, ms; /health, /ready and /metrics "
         "only at --log-level debug)"),
    flag(SERVER, "--log-level", default="info", choices=["debug", "info", "warning", "error"],
         help="the lowest level logged"),
    flag(STRUCTURED, "--structured-outputs-backend", "--guided-decoding-backend",
         default="auto", choices=STRUCTURED_OUTPUTS_BACKENDS,
         help="grammar library for response_format / structured_outputs / forced tool calls "
         "(auto: xgrammar)"),
    flag(STRUCTURED, "--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
         help="tool-call format to parse (default: the one the chat template speaks, else "
         "hermes)"),
    flag(STRUCTURED, "--chat-template", type=non_empty, default=None,
         help="a Jinja chat template to use instead of the model's: a file path, or the "
         "template (default: the model's)"),
    flag(LORA, "--enable-lora", action="store_true",
         help="serve LoRA adapters: a request's `model` names an adapter or the base model"),
    flag(LORA, "--lora-modules", nargs="+", action="extend", default=None,
         metavar="NAME=PATH",
         help="adapters loaded at start: name=path, or JSON {\"name\": ..., \"path\": ..., "
         "\"base_model_name\": ...}; a path is a PEFT adapter directory or a Hugging Face repo "
         "(default: none)"),
    flag(LORA, "--max-loras", type=positive_int, default=DEFAULT_MAX_LORAS,
         help="adapters one step may use (their weights stay on the device)"),
    flag(LORA, "--max-lora-rank", type=positive_int, default=DEFAULT_MAX_LORA_RANK,
         help="the largest adapter rank accepted"),
    flag(LORA, "--max-cpu-loras", type=positive_int, default=None,
         help="adapters kept read in host memory, least recently used out (default: "
         "--max-loras)"),
    flag(LORA, RUNTIME_LORA_FLAG, action="store_true",
         help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also "
         f"{RUNTIME_LORA_ENV}=True)"),
)  # fmt: skip


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    """`kvpilot serve`'s parser: FLAGS, listed by GROUPS in --help."""
    parser = parser_class(
        prog="kvpilot serve",
        description="Serve one model over an OpenAI-compatible HTTP API.",
        formatter_class=DefaultsOnceFormatter,
    )
    groups = {title: parser.add_argument_group(title) for title in GROUPS}
    exclusive: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for spec in FLAGS:
        container: argparse._ActionsContainer = groups[spec.group]
        if spec.exclusive is not None:
            if spec.exclusive not in exclusive:
                exclusive[spec.exclusive] = groups[spec.group].add_mutually_exclusive_group()
            container = exclusive[spec.exclusive]
        container.add_argument(*spec.names, **spec.options)
    return parser


class FlagError(ValueError):
    """Arguments `kvpilot serve` refuses; the message is argparse's or the settings'."""


class _Parser(argparse.ArgumentParser):
    """Raises FlagError where argparse would print and exit the process."""

    def error(self, message: str) -> NoReturn:
        raise FlagError(message)

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        raise FlagError(message or "-h/--help makes `kvpilot serve` print its help and exit")

    def print_help(self, file: object = None) -> None:
        pass  # --help in someone else's process: only its verdict (exit) matters


def read_flags(argv: Sequence[str], *, only_given: bool = False) -> argparse.Namespace:
    """`argv` read as `kvpilot serve`'s parser reads it: FlagError where argparse refuses it (an
    unknown option, a malformed or missing value, -h). The values' own rules are the engine's
    (kvpilot.engine.server.from_flags.parse_flags checks them). only_given: the namespace holds
    only the options that `argv` sets (aliases and abbreviations resolved), for telling which
    ones it sets."""
    parser = build_parser(_Parser)
    if only_given:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
    return parser.parse_args(list(argv))
