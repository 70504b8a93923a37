"""A tensor-parallel worker: ranks 1..N-1, each in a process of its own that rank 0 starts
(`python -m kvpilot.engine.executor.worker STATUS_FD`, arguments on stdin).

It joins the process group, loads its shard of the weights and allocates its shard of the KV
cache, says it is ready, then runs one forward pass per StepInput that rank 0 sends: the same
collectives in the same order as rank 0. It has no scheduler and samples nothing. It exits when
rank 0 says so, when its stdin closes, when its parent dies (PR_SET_PDEATHSIG) and, with an error,
when a collective fails or times out (a peer died).
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import sys
from typing import TYPE_CHECKING

import msgspec

from kvpilot.engine.executor.messages import (
    StopWorker,
    ToWorker,
    WorkerArgs,
    WorkerFailed,
    WorkerReady,
    read_frame,
    write_frame,
)

if TYPE_CHECKING:  # imported late at run time, after logging is set up
    from kvpilot.engine.model_runner import ModelRunner

log = logging.getLogger("kvpilot.tp")


def main(argv: list[str]) -> int:
    status = os.fdopen(int(argv[0]), "wb")
    stdin = sys.stdin.buffer
    head = read_frame(stdin)
    if head is None:
        return 1
    args: WorkerArgs = pickle.loads(head)  # from our own parent, over a private pipe
    from kvpilot.engine.parent_death import die_with_parent

    die_with_parent(args.parent_pid)
    # The terminal or the container runtime signals the whole group: rank 0 stops us instead.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=args.log_level,
        format=f"%(asctime)s %(levelname)s %(name)s[rank {args.rank}]: %(message)s",
        stream=sys.stderr,
    )
    encoder = msgspec.msgpack.Encoder()
    try:
        runner = _load(args)
    except BaseException as exc:
        log.exception("loading rank %d failed", args.rank)
        write_frame(status, encoder.encode(WorkerFailed(args.rank, f"{type(exc).__name__}: {exc}")))
        os._exit(1)
    ready = WorkerReady(args.rank, runner.num_blocks, runner.bytes_loaded)
    write_frame(status, encoder.encode(ready))
    decoder = msgspec.msgpack.Decoder(ToWorker)
    try:
        while (data := read_frame(stdin)) is not None:
            message = decoder.decode(data)
            if isinstance(message, StopWorker):
                break
            if message.lora_fills:
                runner.fill_lora_slots_from_files(message.lora_fills)
            runner.forward_step(message)
    except BaseException:
        log.exception("rank %d failed during a step", args.rank)
        os._exit(1)
    from kvpilot.engine.parallel.group import leave_group

    leave_group()
    return 0


def _load(args: WorkerArgs) -> ModelRunner:
    from pathlib import Path

    import torch

    from kvpilot.engine.config import ModelConfig
    from kvpilot.engine.model.loader import ResolvedModel, read_hf_config, set_offline_defaults
    from kvpilot.engine.model_runner import ModelRunner
    from kvpilot.engine.parallel.group import join_group

    set_offline_defaults()
    torch.set_num_threads(args.num_threads)
    config = args.config
    device = config.rank_device(args.rank)
    if device.type == "cpu" and config.retain_freed_memory:
        from kvpilot.engine.cpu.heap import retain_freed_memory

        retain_freed_memory()
    tp = join_group(
        args.rank, config.tensor_parallel_size, args.init_file, device, config.distributed_timeout_s
    )
    hf_dir = Path(args.hf_dir)
    model_config = ModelConfig.from_hf_config(read_hf_config(hf_dir))
    source = ResolvedModel(hf_dir, hf_dir.name, args.load_format)
    return ModelRunner(config, model_config, source, args.max_model_len, tp=tp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
