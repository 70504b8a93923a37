"""Applying a packed token bitmask to logits: bit j of word w of a row allows token 32 * w + j.

Both grammar backends fill this one format. It is applied with xgrammar's kernel (a C++ loop on
CPU, a GPU kernel on CUDA), which on a busy 2-core VM took ~14 ms against ~38 ms for the unpacking
in torch below at 32 x 49152 (bench/RESULTS.md, issue 16); the torch path stays as the reference.
"""

from __future__ import annotations

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
