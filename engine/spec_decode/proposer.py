"""What makes proposals: the one interface the policy (policy.py) calls, whatever the method
(n-gram: ngram.py, a draft model: draft_model.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kvpilot.engine.config import EngineConfig, ModelConfig
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.ngram import NgramProposer

if TYPE_CHECKING:
    import torch


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """For each sequence, up to num_tokens[i] (>= 1) proposed tokens to follow its
        token_ids (empty: none this step). Called once per step with every sequence that
        speculates in it, so that a model can run them as one batch."""
        ...

    def keep_only(self, running: list[Sequence]) -> None:
        """Called once per step, before propose, with every running sequence: whatever the
        proposer holds for any other sequence (finished, aborted, preempted) can go."""
        ...


def build_proposer(
    config: EngineConfig,
    target: ModelConfig,
    device: torch.device,
    *,
    max_seq_len: int,
    target_pool_tokens: int,
) -> Proposer:
    """The proposer config.speculative's method names (the draft model loaded now, on the
    target's device and in its dtype)."""
    spec = config.speculative
    assert spec is not None
    if spec.method == "draft_model":
        from kvpilot.engine.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(
            config, target, device, max_seq_len=max_seq_len, target_pool_tokens=target_pool_tokens
        )
    return NgramProposer(min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max)
