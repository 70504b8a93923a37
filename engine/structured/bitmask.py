"""Applying a packed token bitmask to logits: bit j of word w of a row allows token 32 * w + j.

Two ways, both exact: the packed bitmask applied after the forward pass, or an additive bias (0 /
-inf) expanded from it on the mask thread while the forward runs, leaving one add for after it
(bench/structured_throughput.py measures both).

Both grammar backends fill this one format. It is applied with xgrammar's kernel (a C++ loop on
CPU, a GPU kernel on CUDA), which on a busy 2-core VM took ~14 ms against ~38 ms for the unpacking
in torch below at 32 x 49152 (bench/RESULTS.md, "Structured outputs"); the torch path stays as
the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 -> [R, V] bool, True where the token is allowed."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """What apply_bitmask does, in plain torch."""
    allowed = unpack_bitmask(bitmask[rows], logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[r, t] to -inf for every r in rows where bitmask[r] forbids token t (in place;
    logits: [S, V] float32, bitmask: [S, ceil(V / 32)] int32 on the same device)."""
    if not rows:
        return
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(
        logits,
        bitmask,
        vocab_size=logits.shape[1],
        indices=None if len(rows) == logits.shape[0] else rows,
    )


def bitmask_to_bias(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 -> [R, V] float32: 0 where allowed, -inf where forbidden."""
    allowed = unpack_bitmask(bitmask, vocab_size)
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=bitmask.device)
    return bias.masked_fill_(~allowed, float("-inf"))


@dataclass(frozen=True)
class GrammarMask:
    """One step's grammar masks for the sampling rows in `rows`, as a packed bitmask (applied
    after the forward: a pass over the bits of every constrained row) or as an additive bias
    built on the mask thread during the forward (then one add on the critical path)."""

    rows: tuple[int, ...]
    bitmask: torch.Tensor | None = None  # [S, ceil(V / 32)] int32
    bias: torch.Tensor | None = None  # [S, V] float32

    def apply(self, logits: torch.Tensor) -> None:
        """Mask logits [S, V] in place (rows outside `rows` untouched)."""
        rows = list(self.rows)
        if not rows:
            return
        if self.bias is not None:
            bias = self.bias.to(logits.device, non_blocking=True)
            if len(rows) == logits.shape[0]:
                logits.add_(bias)
            else:
                logits[rows] += bias[rows]
            return
        assert self.bitmask is not None
        apply_bitmask(logits, self.bitmask.to(logits.device, non_blocking=True), rows)
