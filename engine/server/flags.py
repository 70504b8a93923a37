"""`kvpilot serve`'s flags: its argument parser, their mapping onto the engine's and the server's
settings (which check their values), and reading them without exiting.

Torch-free on purpose: the operator checks spec.engine.extraArgs with this very parser and these
very settings, so that an argument the engine would refuse at start is an InvalidSpec, not a
crash-looping pod. What only the pod can tell (the model, files, the GPUs it sees) is checked by
`kvpilot serve` at start (engine/server/cli.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from kvpilot.contract.limits import RequestLimits
from kvpilot.engine.choices import (
    ATTENTION_BACKENDS,
    BLOCK_SIZES,
    DTYPE_NAMES,
    LOAD_FORMATS,
    STRUCTURED_OUTPUTS_BACKENDS,
)
from kvpilot.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvpilot.engine.cpu.affinity import CpuPlacement, parse_cpu_list
from kvpilot.engine.server.settings import ChatOptions, ServerSettings
from kvpilot.engine.server.tools.parsers import PARSER_NAMES

API_KEY_ENV = "KVPILOT_API_KEY"


def build_parser(
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
) -> argparse.ArgumentParser:
    p = parser_class(
        prog="kvpilot serve",
        description="Serve one model over an OpenAI-compatible HTTP API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m = p.add_argument_group("model")
    m.add_argument(
        "--model",
        default=None,
        help="HF model directory or .gguf file (default: bundled SmolLM2-135M-Instruct)",
    )
    m.add_argument(
        "--served-model-name",
        default=None,
        help="the name clients pass as `model` (default: derived from the model)",
    )
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1")
    h.add_argument(
        "--port", type=port_number, default=8000, help="0 picks a free port (logged at startup)"
    )
    h.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/*; visible to `ps`: prefer "
        f"--api-key-file or ${API_KEY_ENV}",
    )
    h.add_argument(
        "--api-key-file", default=None, help="read the API key from this file (a mounted Secret)"
    )
    g = p.add_argument_group("engine")
    g.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES])
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    g.add_argument("--load-format", default="auto", choices=LOAD_FORMATS)
    g.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly: no CUDA graphs for decode and mixed steps (on CUDA they are "
        "captured at start for the triton attention backend)",
    )
    g.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="launch step N+1 before reading step N's tokens, overlapping host and device work "
        "(default: on for one CUDA rank, off on CPU)",
    )
    sched = p.add_argument_group("scheduler")
    sched.add_argument(
        "--max-model-len", type=int, default=None, help="default: the model's context length"
    )
    g.add_argument("--seed", type=int, default=0)
    kv = p.add_argument_group("KV cache")
    kv.add_argument("--block-size", type=int, default=16, choices=BLOCK_SIZES)
    kv.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    kv.add_argument("--kv-cache-gib", type=float, default=1.0, help="KV-cache budget on CPU")
    kv.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV-cache budget in bytes on CPU or GPU (overrides --kv-cache-gib and the budget "
        "--gpu-memory-utilization leaves)",
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="fraction of GPU memory the engine may use",
    )
    kv.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="exact number of KV blocks (overrides both budgets)",
    )
    par = p.add_argument_group("parallelism")
    par.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="split the model over this many ranks (processes; one GPU each on CUDA)",
    )
    par.add_argument(
        "--distributed-timeout",
        type=float,
        default=120.0,
        help="seconds a tensor-parallel collective waits for the other ranks before failing",
    )
    cpus = par.add_mutually_exclusive_group()
    cpus.add_argument(
        "--engine-cpus",
        type=cpu_list,
        default=None,
        metavar="LIST",
        help="bind the engine core (and its ranks) to these CPUs, e.g. 0-6, one intra-op thread "
        "each, and the API process to the others (default: both on every CPU)",
    )
    cpus.add_argument(
        "--api-cpus",
        type=positive_int,
        default=None,
        metavar="N",
        help="leave N of this process's CPUs to the API process and bind the engine core to the "
        "rest (under a CPU quota alone: N fewer engine threads than the quota)",
    )
    sched.add_argument("--max-num-seqs", type=int, default=128)
    sched.add_argument("--max-num-batched-tokens", type=int, default=2048)
    r = p.add_argument_group("request limits")
    r.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="429 when this many requests wait (default: no limit)",
    )
    r.add_argument("--retry-after", type=int, default=1, help="seconds a 429 tells clients to wait")
    limits = RequestLimits()
    r.add_argument(
        "--max-request-body-bytes", type=int, default=limits.max_body_bytes, help="413 above this"
    )
    r.add_argument(
        "--max-json-depth",
        type=int,
        default=limits.max_json_depth,
        help="400 for a body nested deeper",
    )
    r.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=limits.max_sequences,
        help="400 when prompts x n exceeds it",
    )
    r.add_argument("--max-stop-strings", type=int, default=limits.max_stop, help="per request")
    r.add_argument(
        "--max-logit-bias", type=int, default=limits.max_logit_bias, help="entries per request"
    )
    r.add_argument(
        "--max-tokens-limit",
        type=int,
        default=limits.max_tokens,
        help="400 for a larger max_tokens; also caps an absent one (default: the context)",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM",
    )
    s.add_argument(
        "--disable-vllm-metrics",
        action="store_true",
        help="expose only kvpilot:* metrics, not the vllm:* names",
    )
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    c = p.add_argument_group("structured outputs and tools")
    c.add_argument(
        "--structured-outputs-backend",
        "--guided-decoding-backend",
        default="auto",
        choices=STRUCTURED_OUTPUTS_BACKENDS,
        help="grammar library for response_format / structured_outputs / forced tool calls "
        "(auto: xgrammar)",
    )
    c.add_argument(
        "--tool-call-parser",
        default=None,
        choices=PARSER_NAMES,
        help="tool-call format to parse (default: the one the chat template speaks, else hermes)",
    )
    c.add_argument(
        "--chat-template",
        type=non_empty,
        default=None,
        help="a Jinja chat template to use instead of the model's: a file path, or the template",
    )
    return p  # fmt: skip


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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """Map the flags onto the engine's frozen configs (which validate themselves)."""
    return EngineConfig(
        model=args.model,
        load_format=args.load_format,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        max_model_len=args.max_model_len,
        seed=args.seed,
        served_model_name=args.served_model_name,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_timeout_s=args.distributed_timeout,
        structured_outputs_backend=args.structured_outputs_backend,
        cache=CacheConfig(
            block_size=args.block_size,
            enable_prefix_caching=args.enable_prefix_caching,
            kv_cache_gib=args.kv_cache_gib,
            kv_cache_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            num_blocks=args.num_gpu_blocks_override,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs
        ),
    )


def server_settings(
    args: argparse.Namespace,
    api_key: str | None = None,
    chat: ChatOptions | None = None,
    cpu_placement: CpuPlacement | None = None,
) -> ServerSettings:
    """The server's settings from the flags (ValueError for one out of range); the API key, the
    chat template and the CPU placement of --engine-cpus are found by the caller (from files and
    CPUs only the pod has)."""
    return ServerSettings(
        max_queue=args.max_queue,
        retry_after_s=args.retry_after,
        api_key=api_key,
        limits=request_limits(args),
        chat=chat or ChatOptions(tool_call_parser=args.tool_call_parser),
        shutdown_timeout_s=args.shutdown_timeout,
        cpu_placement=cpu_placement,
    )


def request_limits(args: argparse.Namespace) -> RequestLimits:
    """The request limits the flags set (ValueError for one out of range)."""
    return RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_json_depth=args.max_json_depth,
        max_sequences=args.max_sequences_per_request,
        max_stop=args.max_stop_strings,
        max_logit_bias=args.max_logit_bias,
        max_tokens=args.max_tokens_limit,
    )


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


def parse_flags(argv: Sequence[str], *, only_given: bool = False) -> argparse.Namespace:
    """`argv` read as `kvpilot serve` reads it, with every value check it makes that needs
    neither the model, nor a file, nor the GPUs: FlagError where the command would refuse to
    start. only_given: the namespace holds only the options that `argv` sets (aliases and
    abbreviations resolved), for telling which ones it sets; no value check beyond argparse's."""
    parser = build_parser(_Parser)
    if only_given:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        return parser.parse_args(list(argv))
    args = parser.parse_args(list(argv))
    try:
        engine_config(args)
        server_settings(args)
    except ValueError as error:
        raise FlagError(str(error)) from None
    return args
