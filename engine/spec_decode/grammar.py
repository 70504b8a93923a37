"""Structured outputs with speculation: proposals are cut to what the sequence's grammar takes.

A proposal the grammar refuses could never be emitted (its row's mask forbids it), and the rows
after it would have no grammar state to be masked by; a proposal after which the grammar ends
leaves nothing to verify beyond it. So each constrained sequence's proposals stop before the
first such token; the rows of the rest are then masked by the grammar's state after the
proposals before them (StructuredOutputs.start_masks), and the matcher moves only by the tokens
emitted."""

from __future__ import annotations

from kvpilot.engine.sequence import Sequence


def cut_to_grammar(seqs: list[Sequence]) -> None:
    """Shortens each constrained sequence's spec_token_ids to the prefix its grammar takes."""
    for seq in seqs:
        if seq.grammar is not None and seq.spec_token_ids and not seq.grammar.is_broken:
            seq.spec_token_ids = seq.spec_token_ids[
                : seq.grammar.num_acceptable(seq.spec_token_ids)
            ]
