"""The tensor-parallel process group: joining it, and the two collectives the model needs.

gloo on CPU, NCCL on CUDA, rendezvous through a file that rank 0 names. Every collective runs under
the group's timeout, so a rank that died mid-step fails its peers' next collective instead of
hanging them.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int
    size: int

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place: the row-parallel layers' partial sums."""
        dist.all_reduce(x)
        return x

    def min_over_ranks(self, value: int, device: torch.device) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[S, V/size] on every rank -> [S, V] on rank 0 (None elsewhere): sampling happens on rank
        0 only, where the scheduler and the requests' generators live."""
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.is_first else None
        dist.gather(local, parts, dst=0)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def join_group(
    rank: int, size: int, init_file: str, device: torch.device, timeout_s: float
) -> TPGroup:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return TPGroup(rank, size)


def leave_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
