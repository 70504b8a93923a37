"""What `kvpilot serve` is set to beyond the engine: the queue, the drain, the API key, the request
limits and the chat options, each checked when set. Torch-free: the operator checks
spec.engine.extraArgs with these same rules (engine/server/from_flags.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvpilot.contract.engine_choices import TOOL_CALL_PARSERS
from kvpilot.contract.limits import RequestLimits
from kvpilot.engine.cpu.affinity import CpuPlacement


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat settings: a template to use instead of the model's, and the tool-call
    format to parse (None: the one the template speaks)."""

    chat_template: str | None = None
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, "
                f"got {self.tool_call_parser!r}"
            )


@dataclass(frozen=True)
class ServerSettings:
    max_queue: int | None = None  # None: no limit on waiting requests
    retry_after_s: int = 1  # the Retry-After a 429 carries
    api_key: str | None = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    chat: ChatOptions = field(default_factory=ChatOptions)
    # How long in-flight requests may finish after SIGTERM (0: cut them at once).
    shutdown_timeout_s: float = 30.0
    # --engine-cpus among this machine's CPUs (None: the engine core and the API share them all).
    cpu_placement: CpuPlacement | None = None
    # A log line per request (engine/server/access_log.py); off: --disable-uvicorn-access-log.
    access_log: bool = True

    def __post_init__(self) -> None:
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.retry_after_s < 1:
            raise ValueError(f"retry_after_s must be >= 1, got {self.retry_after_s}")
        # NaN would never time out, infinity never either: a drain must end.
        if not 0 <= self.shutdown_timeout_s < math.inf:
            raise ValueError(
                f"shutdown_timeout_s must be >= 0 and finite, got {self.shutdown_timeout_s}"
            )
