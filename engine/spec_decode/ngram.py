"""N-gram (prompt lookup) proposals: the tokens that followed the latest earlier occurrence of the
sequence's own suffix. No model: right where the output copies its input (RAG, extraction, code
edits, long chats).

A request with a prediction (OpenAI's Predicted Outputs: the file being edited, the answer
expected) is looked up in its prediction first: the output's suffix found there, the occurrence
whose end lies nearest the output's own length (an edit keeps the output near the prediction's
positions, shifted by what it inserted or removed; the nearest of repeated n-grams, such as
indentation, is the likeliest), and the prediction's tokens after it proposed. Where the
prediction has no match, the sequence's own tokens are looked up as without one."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpilot.engine.sequence import Sequence as EngineSequence


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
        suffix = ids[length - n :]
        # Windows starting at 0 .. length-n-1: every occurrence but the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(ids[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return ids[start : start + num_tokens].tolist()
    return []


def propose_from_prediction(
    output_ids: Sequence[int],
    prediction: Sequence[int],
    *,
    min_n: int,
    max_n: int,
    num_tokens: int,
) -> list[int]:
    """Up to num_tokens proposals from the prediction for what follows output_ids (module
    docstring); empty when no suffix of length in [min_n, max_n] of the output occurs in it."""
    length = len(output_ids)
    if num_tokens < 1 or length < min_n or not prediction:
        return []
    out = np.asarray(output_ids[-max_n:], dtype=np.int64)
    pred = np.asarray(prediction, dtype=np.int64)
    for n in range(min(max_n, length, len(pred)), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(pred, n)
        hits = np.flatnonzero((windows == out[len(out) - n :]).all(axis=1))
        if hits.size:
            ends = hits + n
            distance = np.abs(ends - length)
            # Ties go to the later occurrence: an output that inserted text runs ahead.
            end = int(ends[np.flatnonzero(distance == distance.min())[-1]])
            return pred[end : end + num_tokens].tolist()
    return []


class NgramProposer:
    """The Proposer of method ngram (no state between steps)."""

    def __init__(self, *, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, seqs: list[EngineSequence], num_tokens: list[int]) -> list[list[int]]:
        return [self.propose_one(seq, num) for seq, num in zip(seqs, num_tokens, strict=True)]

    def propose_one(self, seq: EngineSequence, num_tokens: int) -> list[int]:
        sizes = {"min_n": self.min_n, "max_n": self.max_n, "num_tokens": num_tokens}
        prediction = seq.params.prediction_token_ids
        if prediction:
            found = propose_from_prediction(seq.output_token_ids, prediction, **sizes)
            if found:
                return found
        return propose_ngram(seq.token_ids, **sizes)

    def keep_only(self, running: list[EngineSequence]) -> None:
        pass
