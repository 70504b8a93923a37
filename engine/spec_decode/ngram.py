"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the
sequence's own suffix. No model: right where the output copies its input (RAG, extraction, code
edits, long chats)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpilot.engine.sequence import Sequence as EngineSequence


def occurrences(tokens: np.ndarray, ngram: np.ndarray) -> np.ndarray:
    """The start of every occurrence of ngram in tokens, in order."""
    windows = np.lib.stride_tricks.sliding_window_view(tokens, len(ngram))
    return np.flatnonzero((windows == ngram).all(axis=1))


def propose_ngram(
    token_ids: Sequence[int], *, min_n: int, max_n: int, num_tokens: int
) -> list[int]:
    """Up to num_tokens proposals for what follows token_ids: for the longest suffix of length
    n in [min_n, max_n] that also occurs earlier, the tokens after its latest earlier occurrence
    (latest: the nearest context is the likeliest to repeat). Empty when no suffix recurs."""
    length = len(token_ids)
    if num_tokens < 1 or length < min_n + 1:
        return []
    ids = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # Searched in all but the last token: every occurrence but the suffix itself.
        hits = occurrences(ids[: length - 1], ids[length - n :])
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + num_tokens].tolist()
    return []


class NgramProposer:
    """The Proposer of method ngram (no state between steps)."""

    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[EngineSequence], num_tokens: list[int]) -> list[list[int]]:
        return [
            propose_ngram(seq.token_ids, min_n=self.min_n, max_n=self.max_n, num_tokens=num)
            for seq, num in zip(seqs, num_tokens, strict=True)
        ]

    def keep_only(self, running: list[EngineSequence]) -> None:
        pass
