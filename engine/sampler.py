"""Turns one row of logits per sampling sequence into a token (and its logprobs), for the whole
batch at once.

Rows under a grammar constraint come with a token bitmask, applied first: their logprobs are those
of the masked distribution (as vLLM reports them), so a forbidden token has logprob -inf.

Randomness comes from each sequence's own torch.Generator when it has a seed, so a seeded request
samples the same tokens whatever else shares its batch. Logprobs are those of the model's raw
distribution (before temperature, penalties and truncation), as vLLM and OpenAI report them.

Every step is a tensor op over the rows that need it, built so that each row gets bit for bit what
a per-row loop over the same ops would give it: per-row parameters become float tensors of the
logits' dtype (a Python scalar in a tensor op is rounded to that dtype too), rows whose feature is
off are left out of the op rather than fed a neutral value that rounding could betray, and sorts
are stable so ties always break towards the lower token id.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.engine.host_copy import to_device
from kvpilot.engine.model import layers
from kvpilot.engine.sampling_params import SamplingParams
from kvpilot.engine.structured.bitmask import GrammarMask


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


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A [R, 1] tensor of per-row values in like's dtype and device, to broadcast over [R, V]."""
    return to_device(values, like.dtype, like.device).unsqueeze(1)


def _index(idx: list[int], like: torch.Tensor) -> torch.Tensor:
    # A list index would be copied to the device from pageable memory (which may wait).
    return to_device(idx, torch.int64, like.device)


def _rows(logits: torch.Tensor, idx: list[int]) -> torch.Tensor:
    # Indexing copies; when every row takes part there is nothing to pick.
    return logits if len(idx) == logits.shape[0] else logits[_index(idx, logits)]


def _put_rows(logits: torch.Tensor, idx: list[int], values: torch.Tensor) -> torch.Tensor:
    """logits with rows idx replaced by values; logits must be a tensor this module owns."""
    if len(idx) == logits.shape[0]:
        return values
    logits[_index(idx, logits)] = values
    return logits


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """The logits with each row's logit_bias added: a copy when any row has one, else the same
    tensor (the caller's logits are never changed)."""
    idx = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if not idx:
        return logits
    row_ids = [i for i in idx for _ in rows[i].params.logit_bias]
    token_ids = [t for i in idx for t, _ in rows[i].params.logit_bias]
    biases = [b for i in idx for _, b in rows[i].params.logit_bias]
    biased = logits.clone()
    # Each (row, token) appears once (SamplingParams checks), so this is one add per entry.
    biased[_index(row_ids, logits), _index(token_ids, logits)] += to_device(
        biases, logits.dtype, logits.device
    )
    return biased


def apply_penalties(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
    """The logits with presence/frequency penalties applied: a copy when any row has some to
    apply, else the same tensor (the caller's logits are never changed)."""
    idx = [i for i, r in enumerate(rows) if r.params.has_penalties and r.output_token_ids]
    if not idx:
        return logits
    vocab = logits.shape[1]
    longest = max(len(rows[i].output_token_ids) for i in idx)
    # Pad with an extra column id so the padding is counted somewhere that is then cut away.
    ids = to_device(
        [
            rows[i].output_token_ids + [vocab] * (longest - len(rows[i].output_token_ids))
            for i in idx
        ],
        torch.int64,
        logits.device,
    )
    # Counted in integers and converted once, as bincount did: a half-precision count would round.
    counts = torch.zeros(len(idx), vocab + 1, dtype=torch.long, device=logits.device)
    counts = counts.scatter_add_(1, ids, torch.ones_like(ids))[:, :vocab].to(logits.dtype)
    frequency = _column([rows[i].params.frequency_penalty for i in idx], logits)
    presence = _column([rows[i].params.presence_penalty for i in idx], logits)
    penalized = logits.clone()
    penalized[_index(idx, logits)] -= frequency * counts + presence * (counts > 0).to(logits.dtype)
    return penalized


def filter_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p on [R, V] (row r with params[r], all of them
    sampling, temperature > 0); removed entries become -inf. Returns a new tensor, or logits
    itself when no row changes anything (temperature 1, no filter: the OpenAI API's default)."""
    vocab = logits.shape[-1]
    k_idx = [i for i, p in enumerate(params) if p.top_k and p.top_k < vocab]
    p_idx = [i for i, p in enumerate(params) if p.top_p < 1.0]
    m_idx = [i for i, p in enumerate(params) if p.min_p > 0.0]
    if not (k_idx or p_idx or m_idx) and all(p.temperature == 1.0 for p in params):
        return logits
    logits = logits / _column([p.temperature for p in params], logits)
    if k_idx:
        sub = _rows(logits, k_idx)
        ks = [params[i].top_k for i in k_idx]
        # The k-th largest value is the same whichever of several tied values topk returns, so one
        # topk up to the largest k serves every row.
        ranks = _index(ks, logits).sub_(1).unsqueeze(1)
        kth = torch.topk(sub, max(ks)).values.gather(1, ranks)
        logits = _put_rows(logits, k_idx, sub.masked_fill(sub < kth, float("-inf")))
    if p_idx:
        sub = _rows(logits, p_idx)
        top_p = _column([params[i].top_p for i in p_idx], logits)
        logits = _put_rows(logits, p_idx, sub.masked_fill(_top_p_drop(sub, top_p), float("-inf")))
    if m_idx:
        sub = _rows(logits, m_idx)
        probs = sub.softmax(-1)
        floor = _column([params[i].min_p for i in m_idx], logits) * probs.amax(-1, keepdim=True)
        logits = _put_rows(logits, m_idx, sub.masked_fill(probs < floor, float("-inf")))
    return logits


# Candidate counts tried before a full sort: a top-p set is usually tens to hundreds of tokens,
# and topk of 256 (4096) of a 49k row costs 6 (22) ms for 64 rows where a stable sort costs 142.
TOP_P_CANDIDATES = (256, 4096)
# How far above top_p the candidates' mass must reach for the rest to be dropped for certain: the
# cumulative sums past the candidates, computed in a full sort, sit at most a few float32 ulps
# below it.
TOP_P_MARGIN = 1e-5


def _top_p_drop(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] mask of the tokens top-p removes: those for which the mass before them, in the order
    of a stable descending sort (ties: lower token id first), already reaches top_p. The
    probabilities are the softmax of the row as it stands (so no sort changes them).

    Only the top candidates of a row are sorted when the tokens strictly above the last
    candidate already hold top_p (plus a margin): every other token then has at least that much
    mass before it and is dropped, and the candidates' cumulative sums are the same prefix a full
    sort's would be (the same values, in the same order, summed one after the other). Rows whose
    top-p set is wider get the full sort."""
    rows, vocab = logits.shape
    probs = logits.softmax(-1)
    drop = torch.ones_like(logits, dtype=torch.bool)
    todo: torch.Tensor | None = None  # rows still open; None: all of them (no index copies)
    # A row that top-k has cut to fewer live tokens than k candidates is always settled here:
    # its last candidate is -inf, so every live token counts as above the edge. (Counting live
    # tokens to take fewer candidates cost more than the larger topk.)
    for k in TOP_P_CANDIDATES:
        if k * 4 > vocab:
            break
        sub_logits, sub_probs, sub_top_p = (
            (logits, probs, top_p) if todo is None else (logits[todo], probs[todo], top_p[todo])
        )
        values, ids = torch.topk(sub_logits, k, sorted=False)
        # Stable descending order: sort by id first, then stably by value.
        ids, by_id = ids.sort(-1)
        values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
        ids = ids.gather(1, by_value)
        cand = sub_probs.gather(1, ids)
        cumulative = cand.cumsum(-1)
        above = values > values[:, -1:]  # strictly above the last candidate's value
        held = torch.where(above, cumulative, torch.zeros_like(cumulative)).amax(-1)
        certain = held >= sub_top_p[:, 0] + TOP_P_MARGIN
        cand_drop = (cumulative - cand) >= sub_top_p
        if todo is None and bool(certain.all()):  # the common case: no row needs more
            return drop.scatter_(1, ids, cand_drop)
        rows_now = torch.arange(rows, device=logits.device) if todo is None else todo
        if bool(certain.any()):
            done = rows_now[certain]
            drop[done] = torch.ones_like(drop[done]).scatter_(1, ids[certain], cand_drop[certain])
        todo = rows_now[~certain]
        if not len(todo):
            return drop
    if todo is None:
        todo = torch.arange(rows, device=logits.device)
    order = torch.sort(logits[todo], dim=-1, descending=True, stable=True).indices
    sorted_probs = probs[todo].gather(1, order)
    # Drop a token when the mass before it already reaches top_p (the first token always stays).
    full_drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p[todo]
    drop[todo] = torch.zeros_like(full_drop).scatter_(1, order, full_drop)
    return drop


def _draw_uniforms(
    generators: list[torch.Generator | None], default: torch.Generator, device: torch.device
) -> torch.Tensor:
    """One U[0, 1) float32 per row: row r from generators[r], or from default when None.

    A seeded row takes the number a lone draw from its generator would give. Rows on the default
    generator share one draw: on CPU its stream is sequential, so element j of an [n] draw is what
    the j-th of n successive single draws would be. That is not assured on CUDA, where each draw
    moves a Philox offset: there unseeded rows may get other numbers than a per-row loop would,
    just as random (nothing promised them the same).
    """
    uniforms = torch.empty(len(generators), dtype=torch.float32, device=device)
    default_idx = [i for i, g in enumerate(generators) if g is None]
    if len(default_idx) == len(generators):
        return uniforms.uniform_(generator=default)
    if default_idx:
        shared = torch.empty(len(default_idx), dtype=torch.float32, device=device)
        uniforms[default_idx] = shared.uniform_(generator=default)
    # In row order, so that rows sharing one generator draw from it as a loop over rows would.
    for i, g in enumerate(generators):
        if g is not None:
            uniforms[i : i + 1].uniform_(generator=g)
    return uniforms


# Tokens per block of the two-level inverse CDF: a cumulative sum over a whole 49k-128k row is
# sequential on CPU (21 ms for 256 x 49152 floats, against 1 ms for the blocks' sums).
CDF_BLOCK = 1024


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of probs [R, V] (non-negative, summing to about 1), the first index whose
    cumulative sum exceeds uniforms[r] times the row's total: a draw from the row's distribution.

    Two levels, so that only one block of each row is ever scanned: the block holding the target
    is found from the blocks' sums, then the token inside it. A zero-probability token is never
    the answer (its cumulative sum equals its predecessor's), and where rounding between the two
    levels would put the target past the chosen block's last token with probability, or before
    its first, the pick is clamped to those tokens."""
    vocab = probs.shape[1]
    full = vocab // CDF_BLOCK
    sums = [probs[:, : full * CDF_BLOCK].unflatten(1, (full, CDF_BLOCK)).sum(-1)]
    if vocab % CDF_BLOCK:
        sums.append(probs[:, full * CDF_BLOCK :].sum(-1, keepdim=True))
    block_sums = torch.cat(sums, dim=1) if len(sums) > 1 else sums[0]  # [R, B]
    block_cdf = block_sums.cumsum(-1)
    total = block_cdf[:, -1:]
    target = torch.minimum(
        uniforms.unsqueeze(1) * total, torch.nextafter(total, total.new_zeros(()))
    )
    block = torch.searchsorted(block_cdf, target, right=True).clamp_(max=block_cdf.shape[1] - 1)
    before = torch.where(
        block > 0, block_cdf.gather(1, (block - 1).clamp_(min=0)), block_cdf.new_zeros(())
    )
    columns = block * CDF_BLOCK + torch.arange(CDF_BLOCK, device=probs.device)  # [R, CDF_BLOCK]
    inside = columns < vocab
    within = probs.gather(1, columns.clamp(max=vocab - 1)).masked_fill_(~inside, 0.0)
    residual = (target - before).clamp_(min=0.0)
    pick = torch.searchsorted(within.cumsum(-1), residual, right=True)
    last_live = CDF_BLOCK - 1 - (within > 0).flip(-1).to(torch.uint8).argmax(-1, keepdim=True)
    return (block * CDF_BLOCK + torch.minimum(pick, last_live)).squeeze(1)


def sampled_logprobs(
    logits: torch.Tensor, rows: list[SamplerRow], token_ids: torch.Tensor
) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
    """Chosen-token logprob, its rank and the top-N of the raw distribution, for rows that asked."""
    out: list[tuple[float, int, list[tuple[int, float]]] | None] = [None] * len(rows)
    idx = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not idx:
        return out
    lp = torch.log_softmax(_rows(logits, idx), dim=-1)
    chosen_ids = _rows(token_ids.unsqueeze(1), idx)
    chosen = lp.gather(1, chosen_ids)
    ranks = ((lp > chosen).sum(-1) + 1).tolist()
    chosen_values = chosen.squeeze(1).tolist()
    top: dict[int, list[tuple[int, float]]] = {}
    # One topk per distinct N, not one up to the largest N: among tied logprobs topk(N) is not a
    # prefix of topk(M > N) on CPU, and each row must get what topk(N) alone gives it.
    by_n: dict[int, list[int]] = {}
    for j, i in enumerate(idx):
        n = rows[i].params.logprobs
        if n:
            by_n.setdefault(n, []).append(j)
    for n, js in by_n.items():
        values, ids = torch.topk(_rows(lp, js), n)
        for j, row_ids, row_values in zip(js, ids.tolist(), values.tolist(), strict=True):
            top[j] = list(zip(row_ids, row_values, strict=True))
    for j, i in enumerate(idx):
        out[i] = (chosen_values[j], ranks[j], top.get(j, []))
    return out


@dataclass(frozen=True)
class LaunchedSample:
    """A step's draws as they sit on the device: the token ids, and what the logprobs need."""

    token_ids: torch.Tensor  # [S] int64 on the logits' device
    raw_logits: torch.Tensor  # [S, V] before penalties, bias and truncation (after a grammar mask)
    rows: list[SamplerRow]
    # A pinned host copy of token_ids under way, and the event that marks it done (CUDA only).
    host_copy: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None


def launch_sample(
    logits: torch.Tensor,
    rows: list[SamplerRow],
    default_generator: torch.Generator,
    grammar_mask: GrammarMask | None = None,
    argmax_rows: Callable[[torch.Tensor], torch.Tensor] = layers.argmax_rows,
) -> LaunchedSample:
    """logits: [S, V] float32, one row per sequence that samples this step; the constrained rows
    are masked in place first. Queues the sampling on the device and returns without waiting for
    it (unless a filter needs a value on the host: top-p's candidate check). argmax_rows: the
    greedy rows' pick (a backend's own, from its LayerOps)."""
    if grammar_mask is not None:
        grammar_mask.apply(logits)
    raw_logits = logits
    logits = apply_penalties(apply_logit_bias(logits, rows), rows)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    sampling = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if not sampling:  # an all-greedy batch (the common case) skips copying the rows out first
        token_ids = argmax_rows(logits)
    else:
        token_ids = torch.empty(len(rows), dtype=torch.int64, device=logits.device)
        if greedy:
            token_ids[greedy] = argmax_rows(_rows(logits, greedy))
        probs = filter_logits(_rows(logits, sampling), [rows[i].params for i in sampling])
        probs = probs.softmax(-1)
        # Inverse-CDF sampling: the first token whose cumulative probability exceeds u ~ U[0, 1)
        # (times the row's total, which rounding leaves near 1). One number per row instead of an
        # Exp(1) draw per vocabulary entry (the exponential race argmax(p / E)): on CPU, 64 rows
        # of a 49k vocabulary took ~30 ms of exponential_ alone, more than a decode step. A seeded
        # row's u comes only from its own generator, so its draw does not depend on the batch.
        uniforms = _draw_uniforms(
            [rows[i].generator for i in sampling], default_generator, probs.device
        )
        drawn = inverse_cdf(probs, uniforms)
        token_ids = _put_rows(token_ids, sampling, drawn)
    if token_ids.device.type != "cuda":
        return LaunchedSample(token_ids, raw_logits, rows)
    host_copy = torch.empty(token_ids.shape, dtype=token_ids.dtype, pin_memory=True)
    host_copy.copy_(token_ids, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return LaunchedSample(token_ids, raw_logits, rows, host_copy, copied)


def resolve_sample(launched: LaunchedSample) -> SampleResult:
    """The step's tokens on the host (waiting for the device: the step loop's one
    synchronization), with the logprobs of the rows that asked."""
    if launched.copied is not None and launched.host_copy is not None:
        launched.copied.synchronize()
        token_list = launched.host_copy.tolist()
    else:
        token_list = launched.token_ids.tolist()
    logprobs = sampled_logprobs(launched.raw_logits, launched.rows, launched.token_ids)
    return SampleResult(token_list, logprobs)


def sample(
    logits: torch.Tensor,
    rows: list[SamplerRow],
    default_generator: torch.Generator,
    grammar_mask: GrammarMask | None = None,
) -> SampleResult:
    """launch_sample then resolve_sample: the tokens of [S, V] float32 logits on the host."""
    if not rows:
        return SampleResult([], [])
    return resolve_sample(launch_sample(logits, rows, default_generator, grammar_mask))
