"""Verification of proposals against the target model, one row of logits per verified position.

A sequence with k proposals d_0..d_{k-1} was run as a query of k+1 tokens (its last token, then
the proposals); row i of its logits is the target's distribution p_i of the token after position
i. What comes back is the accepted proposals and one token more (the correction at the first
rejection, or the bonus token after k accepted ones): 1 to k+1 tokens, always at least what a
step without speculation gives.

- Greedy: d_i is accepted while it is the target's argmax, so the tokens are exactly those of
  decoding without speculation.
- Sampled: rejection sampling (Leviathan et al., Chen et al.) with a one-hot draft (an n-gram
  proposal has no distribution of its own): d_i is accepted with probability p_i(d_i); on
  rejection the token is drawn from p_i with d_i removed, renormalized. Each emitted token then
  follows the target distribution, as if drawn without speculation.

Each row first gets what a step without speculation would give it at that position: the grammar's
mask after the proposals before it (applied by the caller), the penalties counting those
proposals as output. A token the mask forbids has probability 0, so it is never accepted nor
drawn.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.sampler import (
    SamplerRow,
    apply_logit_bias,
    apply_penalties,
    filter_logits,
    inverse_cdf,
    sampled_logprobs,
)

if TYPE_CHECKING:
    from kvpilot.engine.core.messages import SampledLogprobs


def greedy_accept(target_ids: list[int], draft_ids: list[int]) -> list[int]:
    """target_ids: the argmax of each of the k+1 rows; the accepted proposals and the token
    after them."""
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return target_ids[: accepted + 1]


def rejection_sample(
    probs: torch.Tensor, draft_ids: list[int], uniforms: torch.Tensor
) -> list[int]:
    """probs: [k+1, V] target distributions; uniforms: k+1 independent U[0, 1) numbers (the
    first k test the proposals, the last draws the final token). Returns the accepted proposals
    and the token after them."""
    k = len(draft_ids)
    u = uniforms.tolist()
    if k:
        rows = torch.arange(k, device=probs.device)
        accept_probs = probs[rows, torch.tensor(draft_ids, device=probs.device)].tolist()
    else:
        accept_probs = []
    out: list[int] = []
    for i in range(k):
        if u[i] < accept_probs[i]:
            out.append(draft_ids[i])
            continue
        residual = probs[i].clone()
        residual[draft_ids[i]] = 0.0
        if float(residual.sum()) <= 0.0:  # p_i was all on d_i (u rounded past it): keep it
            out.append(draft_ids[i])
            continue
        out.append(int(inverse_cdf(residual.unsqueeze(0), uniforms[k : k + 1])[0]))
        return out
    out.append(int(inverse_cdf(probs[k : k + 1], uniforms[k : k + 1])[0]))
    return out


@dataclass(frozen=True)
class VerifyRow:
    """One speculating sequence: its sampling row (params, generator, and for the penalties its
    output tokens before the proposals) and its proposals."""

    row: SamplerRow
    draft_ids: list[int]

    def position_rows(self) -> list[SamplerRow]:
        """The sampling row of each of the k+1 positions: position i follows the output tokens
        and the proposals before it, as decoding them one by one would see it."""
        r = self.row
        if not r.params.has_penalties:
            return [r] * (len(self.draft_ids) + 1)
        return [
            SamplerRow(r.params, [*r.output_token_ids, *self.draft_ids[:i]], r.generator)
            for i in range(len(self.draft_ids) + 1)
        ]


@dataclass(frozen=True)
class Verified:
    """Per sequence: its accepted proposals and the token after them, and for a sequence that
    asked for logprobs each of those tokens' (None otherwise)."""

    token_ids: list[list[int]]
    logprobs: list[list[SampledLogprobs] | None]


def verify(
    logits: torch.Tensor,
    seqs: list[VerifyRow],
    default_generator: torch.Generator,
    argmax_rows: Callable[[torch.Tensor], torch.Tensor],
) -> Verified:
    """logits: [sum(k_s + 1), V] float32, each sequence's k_s + 1 rows in turn, a grammar's mask
    already applied (row i under the grammar's state after the proposals before it). Per
    sequence, its accepted proposals and the token after them. The rows get what a step without
    speculation applies to them (logit bias, penalties over the output and the proposals before
    the row, then temperature, top-k, top-p, min-p); logprobs are those of the masked logits, as
    without speculation."""
    spans = []
    start = 0
    for s in seqs:
        spans.append((start, start + len(s.draft_ids) + 1))
        start = spans[-1][1]
    position_rows = [r for s in seqs for r in s.position_rows()]
    raw_logits = logits
    logits = apply_penalties(apply_logit_bias(logits, position_rows), position_rows)
    out: list[list[int]] = [[] for _ in seqs]
    greedy = [i for i, s in enumerate(seqs) if s.row.params.is_greedy]
    if greedy:
        rows = [r for i in greedy for r in range(*spans[i])]
        targets = argmax_rows(logits[rows]).tolist()
        offset = 0
        for i in greedy:
            n = len(seqs[i].draft_ids) + 1
            out[i] = greedy_accept(targets[offset : offset + n], seqs[i].draft_ids)
            offset += n
    for i, s in enumerate(seqs):
        if s.row.params.is_greedy:
            continue
        a, b = spans[i]
        probs = filter_logits(logits[a:b], [s.row.params] * (b - a)).softmax(-1)
        uniforms = torch.empty(b - a, dtype=torch.float32, device=logits.device)
        uniforms.uniform_(generator=s.row.generator or default_generator)
        out[i] = rejection_sample(probs, s.draft_ids, uniforms)
    return Verified(out, _emitted_logprobs(raw_logits, seqs, spans, position_rows, out))


def _emitted_logprobs(
    raw_logits: torch.Tensor,
    seqs: list[VerifyRow],
    spans: list[tuple[int, int]],
    position_rows: list[SamplerRow],
    emitted: list[list[int]],
) -> list[list[SampledLogprobs] | None]:
    """The logprobs of each emitted token from its own row, in one batch over the sequences
    that asked for them."""
    asking = [i for i, s in enumerate(seqs) if s.row.params.logprobs is not None]
    out: list[list[SampledLogprobs] | None] = [None] * len(seqs)
    if not asking:
        return out
    rows = [spans[i][0] + j for i in asking for j in range(len(emitted[i]))]
    tokens = [t for i in asking for t in emitted[i]]
    index = torch.tensor(rows, device=raw_logits.device)
    values = sampled_logprobs(
        raw_logits[index],
        [position_rows[r] for r in rows],
        torch.tensor(tokens, dtype=torch.int64, device=raw_logits.device),
    )
    offset = 0
    for i in asking:
        n = len(emitted[i])
        out[i] = [v for v in values[offset : offset + n] if v is not None]
        offset += n
    return out
