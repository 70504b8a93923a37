"""Proposals from a request's prediction (OpenAI's Predicted Outputs: the file being edited, the
answer expected), looked up before the method's own (n-gram or a draft model).

The output's suffix is found in the prediction, the occurrence whose end lies nearest the
output's own length taken (an edit keeps the output near the prediction's positions, shifted by
what it inserted or removed; of repeated n-grams, such as indentation, the nearest is the
likeliest), and the prediction's tokens after it proposed; an output still shorter than the
shortest n-gram looked up (its first decode steps) is proposed the prediction's continuation
where it is how the prediction starts. Where the prediction has no match,
the method proposes as without one: a draft model then catches up on the tokens it did not see
(draft_model.py), as after any step it sat out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvpilot.engine.sequence import Sequence as EngineSequence
from kvpilot.engine.spec_decode.ngram import occurrences
from kvpilot.engine.spec_decode.proposer import Proposer


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
    if num_tokens < 1 or not prediction:
        return []
    if length < min_n:  # too short to look up: aligned by position, if the prediction starts so
        if list(prediction[:length]) == list(output_ids):
            return list(prediction[length : length + num_tokens])
        return []
    out = np.asarray(output_ids[-max_n:], dtype=np.int64)
    pred = np.asarray(prediction, dtype=np.int64)
    for n in range(min(max_n, length, len(pred)), min_n - 1, -1):
        hits = occurrences(pred, out[len(out) - n :])
        if hits.size:
            ends = hits + n
            distance = np.abs(ends - length)
            # Ties go to the later occurrence: an output that inserted text runs ahead.
            end = int(ends[np.flatnonzero(distance == distance.min())[-1]])
            return pred[end : end + num_tokens].tolist()
    return []


def propose_with_predictions(
    proposer: Proposer,
    seqs: list[EngineSequence],
    num_tokens: list[int],
    *,
    min_n: int,
    max_n: int,
) -> list[list[int]]:
    """Each sequence's proposals: from its prediction where that has a match, else from
    `proposer` (asked once, for all the others together)."""
    out: list[list[int]] = []
    others: list[int] = []
    for i, (seq, num) in enumerate(zip(seqs, num_tokens, strict=True)):
        prediction = seq.params.prediction_token_ids
        found = (
            propose_from_prediction(
                seq.output_token_ids, prediction, min_n=min_n, max_n=max_n, num_tokens=num
            )
            if prediction
            else []
        )
        out.append(found)
        if not found:
            others.append(i)
    if others:
        asked = proposer.propose([seqs[i] for i in others], [num_tokens[i] for i in others])
        for i, proposal in zip(others, asked, strict=True):
            out[i] = proposal
    return out
