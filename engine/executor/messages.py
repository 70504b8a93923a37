"""What rank 0 and the other tensor-parallel ranks say to each other besides the collectives.

Rank 0 -> worker, on the worker's stdin: the start arguments (pickled, once), then one msgpack
frame per step (a StepInput) until StopWorker. Worker -> rank 0, on a pipe of its own: one
WorkerReady or WorkerFailed after loading. Frames are length-prefixed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import BinaryIO

import msgspec

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.step_input import StepInput

_LENGTH = struct.Struct("<Q")


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    hf_dir: str
    load_format: str
    max_model_len: int
    rank: int
    init_file: str  # the torch.distributed rendezvous file
    num_threads: int
    log_level: int
    parent_pid: int


class StopWorker(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class WorkerReady(msgspec.Struct, frozen=True, array_like=True, tag=True):
    rank: int
    num_blocks: int
    bytes_loaded: int


class WorkerFailed(msgspec.Struct, frozen=True, array_like=True, tag=True):
    rank: int
    message: str


ToWorker = StepInput | StopWorker
FromWorker = WorkerReady | WorkerFailed


def write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(_LENGTH.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_frame(stream: BinaryIO) -> bytes | None:
    """The next frame; None at end of stream (the writer is gone)."""
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (size,) = _LENGTH.unpack(head)
    data = stream.read(size)
    return data if len(data) == size else None
