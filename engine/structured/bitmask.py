"""Applying a packed token bitmask to logits: bit j of word w of a row allows token 32 * w + j."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, ceil(V / 32)] int32 -> [R, V] bool, True where the token is allowed."""
    bits = _BITS.to(bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab_size]


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[rows[i], t] to -inf where bitmask row i forbids token t (in place)."""
    if not rows:
        return
    allowed = unpack_bitmask(bitmask, logits.shape[1])
    if len(rows) == logits.shape[0]:
        logits.masked_fill_(~allowed, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
