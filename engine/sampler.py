"""Turns one row of logits per sampling sequence into a token (and its logprobs).

Randomness comes from each sequence's own torch.Generator when it has a seed, so a seeded request
samples the same tokens whatever else shares its batch. Logprobs are those of the model's raw
distribution (before temperature, penalties and truncation), as vLLM and OpenAI report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpilot.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplerRow:
    params: SamplingParams
    output_token_ids: list[int]  # for the penalties
    generator: torch.Generator | None


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    # Per row: (sampled token logprob, its rank, top-N [(token, logprob)]) when the row asked for
    # logprobs.
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """The logits with presence/frequency penalties applied: a copy when any row has some to
    apply, else the same tensor (the caller's logits are never changed)."""
    penalized = None
    for i, row in enumerate(rows):
        p = row.params
        if not p.has_penalties or not row.output_token_ids:
            continue
        if penalized is None:
            penalized = logits.clone()
        ids = torch.tensor(row.output_token_ids, device=logits.device)
        counts = torch.bincount(ids, minlength=logits.shape[1]).to(logits.dtype)
        penalized[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(
            logits.dtype
        )
    return logits if penalized is None else penalized


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on one row [V]; removed entries become -inf."""
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, rows: list[SamplerRow], default_generator: torch.Generator
) -> SampleResult:
    """logits: [S, V] float32, one row per sequence that samples this step."""
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1)
        if any(r.params.logprobs is not None for r in rows)
        else None
    )
    logits = apply_penalties(logits, rows)
    token_ids: list[int] = []
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    greedy_tokens: list[int] = []
    if greedy:
        # An all-greedy batch (the common case) skips copying the rows out first.
        greedy_logits = logits if len(greedy) == len(rows) else logits[greedy]
        greedy_tokens = greedy_logits.argmax(-1).tolist()
    greedy_by_row = dict(zip(greedy, greedy_tokens, strict=True))
    for i, row in enumerate(rows):
        if i in greedy_by_row:
            token_ids.append(greedy_by_row[i])
            continue
        probs = filter_logits(logits[i], row.params).softmax(-1)
        # Exponential-race sampling: argmax(p / E) with E ~ Exp(1) draws from p, using only this
        # row's generator, so the draw does not depend on the batch.
        noise = torch.empty_like(probs).exponential_(generator=row.generator or default_generator)
        token_ids.append(int((probs / noise).argmax()))
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None] = []
    for i, row in enumerate(rows):
        if raw_logprobs is None or row.params.logprobs is None:
            logprobs.append(None)
            continue
        lp = raw_logprobs[i]
        chosen = float(lp[token_ids[i]])
        rank = int((lp > chosen).sum()) + 1
        top: list[tuple[int, float]] = []
        if row.params.logprobs:
            values, ids = torch.topk(lp, row.params.logprobs)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        logprobs.append((chosen, rank, top))
    return SampleResult(token_ids, logprobs)
