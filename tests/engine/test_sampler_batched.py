"""The batched sampler against the per-row sampler it replaced: same tokens, same logprobs, bit for
bit, for every sampling parameter and for batches mixing them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvpilot.engine.sampler import (
    SampleResult,
    SamplerRow,
    apply_penalties,
    filter_logits,
    sample,
)
from kvpilot.engine.sampling_params import SamplingParams

VOCAB = 512
ROWS = 8

# ---- the per-row sampler as it was before batching (the reference) ----
# Copied unchanged except for one flag: stable_sort=True makes top-p's sort stable. The old code
# used an unstable sort, whose order among tied logits is unspecified (std::sort on CPU), so on
# logits with ties only a stable reference defines what "the same" is. Without ties both orders
# agree, and the tests on tie-free logits use the old sort exactly as it was.


def reference_apply_penalties(logits: torch.Tensor, rows: list[SamplerRow]) -> torch.Tensor:
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


def reference_filter_logits(
    logits: torch.Tensor, p: SamplingParams, stable_sort: bool = False
) -> torch.Tensor:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        order = torch.sort(logits, descending=True, stable=stable_sort).indices
        probs = logits.softmax(-1)[order]  # the softmax of the row as it stands, then sorted
        drop = (probs.cumsum(-1) - probs) >= p.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


def reference_sample(
    logits: torch.Tensor,
    rows: list[SamplerRow],
    default_generator: torch.Generator,
    stable_sort: bool = False,
) -> SampleResult:
    raw_logprobs = (
        torch.log_softmax(logits, dim=-1)
        if any(r.params.logprobs is not None for r in rows)
        else None
    )
    logits = reference_apply_penalties(logits, rows)
    token_ids: list[int] = []
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    greedy_tokens: list[int] = []
    if greedy:
        greedy_logits = logits if len(greedy) == len(rows) else logits[greedy]
        greedy_tokens = greedy_logits.argmax(-1).tolist()
    greedy_by_row = dict(zip(greedy, greedy_tokens, strict=True))
    for i, row in enumerate(rows):
        if i in greedy_by_row:
            token_ids.append(greedy_by_row[i])
            continue
        probs = reference_filter_logits(logits[i], row.params, stable_sort).softmax(-1)
        u = torch.rand(1, generator=row.generator or default_generator)
        cdf = probs.cumsum(-1)
        # The number of cumulative sums at or below the target is the first index above it.
        target = min(float(u * cdf[-1]), float(torch.nextafter(cdf[-1], torch.tensor(0.0))))
        token_ids.append(int((cdf <= target).sum()))
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


# ---- helpers ----

Sampler = Callable[[torch.Tensor, list[SamplerRow], torch.Generator], SampleResult]


def random_logits(seed: int, ties: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3.0
    # Rounded to a coarse grid, many logits tie, near the top too.
    return logits.round() if ties else logits


def generators_for(seeds: list[int | None]) -> list[torch.Generator | None]:
    return [None if s is None else torch.Generator().manual_seed(s) for s in seeds]


def run_steps(
    sampler: Sampler,
    params: list[SamplingParams],
    seeds: list[int | None],
    steps: int = 4,
    ties: bool = False,
    logits_seed: int = 0,
) -> list[SampleResult]:
    """steps sampling steps of one batch, each row feeding back its tokens (for the penalties),
    with fresh generators: the same inputs for any sampler."""
    generators = generators_for(seeds)
    default = torch.Generator().manual_seed(99)
    outputs: list[list[int]] = [[3, 3, 7, 500] if i % 2 else [] for i in range(len(params))]
    results = []
    for step in range(steps):
        logits = random_logits(logits_seed * 1000 + step, ties)[: len(params)]
        before = logits.clone()
        rows = [
            SamplerRow(p, list(out), g)
            for p, out, g in zip(params, outputs, generators, strict=True)
        ]
        result = sampler(logits, rows, default)
        assert torch.equal(logits, before)  # the caller's logits are never modified
        for out, t in zip(outputs, result.token_ids, strict=True):
            out.append(t)
        results.append(result)
    # Both samplers must leave the shared stream where the other does.
    results.append(SampleResult([int(torch.randint(1 << 30, (1,), generator=default))], []))
    return results


def stable_reference(
    logits: torch.Tensor, rows: list[SamplerRow], default_generator: torch.Generator
) -> SampleResult:
    return reference_sample(logits, rows, default_generator, stable_sort=True)


def assert_same(
    params: list[SamplingParams], seeds: list[int | None], steps: int = 4, logits_seed: int = 0
) -> None:
    new = run_steps(sample, params, seeds, steps=steps, logits_seed=logits_seed)
    ref = run_steps(reference_sample, params, seeds, steps=steps, logits_seed=logits_seed)
    for step, (n, r) in enumerate(zip(new, ref, strict=True)):
        assert n.token_ids == r.token_ids, f"step {step}"
        assert n.logprobs == r.logprobs, f"step {step}"


sp = SamplingParams


# ---- one parameter at a time, the same on every row ----

SINGLE = {
    "greedy": sp(temperature=0.0),
    "temperature_1": sp(temperature=1.0),
    "temperature_0.3": sp(temperature=0.3),
    "temperature_1.7": sp(temperature=1.7),
    "top_k_1": sp(top_k=1),
    "top_k_5": sp(top_k=5),
    "top_k_vocab-1": sp(top_k=VOCAB - 1),
    "top_k_vocab": sp(top_k=VOCAB),
    "top_k_beyond_vocab": sp(top_k=VOCAB + 100),
    "top_p_0.05": sp(top_p=0.05),
    "top_p_0.5": sp(top_p=0.5),
    "top_p_0.9": sp(top_p=0.9, temperature=0.7),
    "min_p_0.1": sp(min_p=0.1),
    "min_p_0.6": sp(min_p=0.6, temperature=1.5),
    "presence": sp(presence_penalty=1.5),
    "frequency": sp(frequency_penalty=0.8),
    "negative_penalties": sp(frequency_penalty=-1.3, presence_penalty=-0.4),
    "greedy_penalized": sp(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0),
    "all_filters": sp(temperature=0.8, top_k=40, top_p=0.8, min_p=0.02),
    "logprobs_0": sp(logprobs=0),
    "logprobs_5_greedy": sp(temperature=0.0, logprobs=5),
    "logprobs_20": sp(logprobs=20, top_k=10),
}


@pytest.mark.parametrize("name", list(SINGLE))
def test_each_parameter_matches_the_per_row_sampler(name: str) -> None:
    assert_same([SINGLE[name]] * ROWS, [None] * ROWS)


@pytest.mark.parametrize(
    "name", ["temperature_1", "top_k_5", "top_p_0.5", "min_p_0.1", "frequency"]
)
def test_seeded_rows_match_token_for_token(name: str) -> None:
    assert_same([SINGLE[name]] * ROWS, list(range(100, 100 + ROWS)), steps=6)


# ---- mixed batches ----

MIXED = [
    sp(temperature=0.0),
    sp(temperature=0.9, top_p=0.95, top_k=50, logprobs=3),
    sp(temperature=1.0, logprobs=0),
    sp(temperature=0.0, frequency_penalty=1.0, logprobs=20),
    sp(temperature=0.7, min_p=0.05, presence_penalty=0.5),
    sp(temperature=1.2, top_k=3),
    sp(temperature=0.5, top_p=0.6, frequency_penalty=-0.5, logprobs=1),
    sp(temperature=1.0, top_k=VOCAB, top_p=1.0, min_p=0.0, logprobs=3),
]
MIXED_SEEDS: list[int | None] = [None, 7, None, 11, 5, None, 7, None]  # two rows seed 7 alike


def test_mixed_batch_of_greedy_seeded_and_unseeded_rows() -> None:
    assert_same(MIXED, MIXED_SEEDS, steps=6)


def test_mixed_batch_all_seeded_and_all_unseeded() -> None:
    assert_same(MIXED, list(range(ROWS)), steps=3, logits_seed=1)
    assert_same(MIXED, [None] * ROWS, steps=3, logits_seed=2)


def test_mixed_batch_with_tied_logits() -> None:
    new = run_steps(sample, MIXED, MIXED_SEEDS, steps=6, ties=True)
    ref = run_steps(stable_reference, MIXED, MIXED_SEEDS, steps=6, ties=True)
    assert [r.token_ids for r in new] == [r.token_ids for r in ref]
    assert [r.logprobs for r in new] == [r.logprobs for r in ref]
    # the ties really reach the rows' top-N (so tie order in topk is exercised)
    top = ref[0].logprobs[3]
    assert top is not None and len({lp for _, lp in top[2]}) < len(top[2])


def test_top_p_on_ties_keeps_the_lower_token_id() -> None:
    # Two equal halves of the mass: top_p=0.5 keeps exactly the first of them in a stable order.
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, [40, 9]] = 2.0
    kept = filter_logits(logits, [sp(top_p=0.5)])
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [9]


def test_top_p_after_top_k_on_ties_keeps_the_lower_token_id() -> None:
    # The same with top-k first, where top-p sorts only top-k's survivors.
    logits = torch.zeros(1, VOCAB)
    logits[0, [40, 9]] = 8.0
    kept = filter_logits(logits, [sp(top_k=2, top_p=0.5)])
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [9]


TOP_K_TOP_P = [
    sp(top_k=k, top_p=q, temperature=t)
    for k in (1, 2, 7, 50, 128, 129, 300)
    for q in (0.05, 0.5, 0.9, 0.999)
    for t in (0.5, 1.0)
]


@pytest.mark.parametrize("ties", [False, True])
def test_top_p_after_top_k_matches_a_full_sort(ties: bool) -> None:
    # Rows that top-k cut to few tokens (128 of 512 or fewer) sort only those for top-p; the rest
    # sort the whole row: both must give what a full stable sort gives. Some rows have fewer finite
    # logits than k, and with ties top-k keeps more than k.
    logits = torch.cat([random_logits(s, ties) for s in range(7)])[: len(TOP_K_TOP_P)]
    logits[::5, 100:] = float("-inf")
    expected = torch.stack(
        [reference_filter_logits(logits[i], p, stable_sort=True) for i, p in enumerate(TOP_K_TOP_P)]
    )
    assert torch.equal(filter_logits(logits, TOP_K_TOP_P), expected)
    # one k at a time too, so that the small ks take the short sort together
    for k in (1, 2, 7, 50, 128):
        idx = [i for i, p in enumerate(TOP_K_TOP_P) if p.top_k == k]
        assert torch.equal(filter_logits(logits[idx], [TOP_K_TOP_P[i] for i in idx]), expected[idx])


def test_logprobs_with_a_different_n_per_row_on_ties() -> None:
    params = [sp(temperature=0.0, logprobs=n) for n in [0, 1, 2, 3, 5, 20, None, 5]]
    new = run_steps(sample, params, [None] * ROWS, ties=True)
    ref = run_steps(reference_sample, params, [None] * ROWS, ties=True)
    assert [r.logprobs for r in new] == [r.logprobs for r in ref]
    assert [len(lp[2]) if lp else None for lp in new[0].logprobs] == [0, 1, 2, 3, 5, 20, None, 5]


# ---- the pieces ----


def test_filter_logits_batched_equals_per_row() -> None:
    params = [SINGLE[n] for n in SINGLE if not SINGLE[n].is_greedy]
    for ties in (False, True):
        logits = torch.cat([random_logits(s, ties) for s in range(3)])[: len(params)]
        batched = filter_logits(logits, params)
        for i, p in enumerate(params):
            assert torch.equal(batched[i], reference_filter_logits(logits[i], p, stable_sort=True))


def test_penalties_batched_equal_per_row_and_skip_the_copy_when_none_apply() -> None:
    logits = random_logits(3)
    outputs = [[1, 1, 1, 2], [], [5] * 9 + [511], [0, 7], [], [2], [9, 9], [100] * 40]
    params = [
        sp(frequency_penalty=0.5 * (i % 3), presence_penalty=-0.7 * (i % 2)) for i in range(ROWS)
    ]
    rows = [SamplerRow(p, o, None) for p, o in zip(params, outputs, strict=True)]
    assert torch.equal(apply_penalties(logits, rows), reference_apply_penalties(logits, rows))
    assert not torch.equal(apply_penalties(logits, rows), logits)
    plain = [SamplerRow(sp(), o, None) for o in outputs]
    assert apply_penalties(logits, plain) is logits
    no_history = [SamplerRow(sp(presence_penalty=1.0), [], None) for _ in outputs]
    assert apply_penalties(logits, no_history) is logits


def test_default_generator_rows_draw_the_same_stream_as_one_draw_per_row() -> None:
    # The batched sampler draws the uniforms of all unseeded rows at once: on CPU that is the same
    # numbers as one draw per row, in row order.
    a = torch.Generator().manual_seed(4)
    b = torch.Generator().manual_seed(4)
    per_row = torch.cat([torch.rand(1, generator=a) for _ in range(5)])
    assert torch.equal(torch.empty(5).uniform_(generator=b), per_row)


def test_seeded_row_does_not_depend_on_its_batch() -> None:
    seeded = sp(temperature=1.0, top_p=0.9, top_k=100, seed=3)

    def tokens(batch: list[SamplingParams], seeds: list[int | None], at: int) -> list[int]:
        results = run_steps(sample, batch, seeds, steps=6)[:-1]
        return [r.token_ids[at] for r in results]

    alone = tokens([seeded], [42], 0)
    # Row 0's logits are the same in every batch; the other rows' parameters and seeds differ.
    crowd = tokens([seeded, *MIXED[1:]], [42, None, 1, None, 2, None, 3, None], 0)
    other = tokens([seeded, *[sp(temperature=0.5)] * 5], [42, None, None, 9, 9, None], 0)
    assert alone == crowd == other
    unseeded = tokens([sp(temperature=1.0, top_p=0.9, top_k=100)] * 2, [None, None], 0)
    assert alone != unseeded  # the seed, not chance, made them equal


def test_the_comparison_notices_a_one_step_difference() -> None:
    # assert_same's checks are able to fail: a reference with a slightly different top_p, or a
    # differently seeded generator, gives different tokens on these logits.
    params = [sp(top_p=0.5)] * ROWS
    new = run_steps(sample, params, list(range(ROWS)))
    other = run_steps(reference_sample, [sp(top_p=0.6)] * ROWS, list(range(ROWS)))
    assert [r.token_ids for r in new] != [r.token_ids for r in other]
    reseeded = run_steps(reference_sample, params, list(range(1, ROWS + 1)))
    assert [r.token_ids for r in new] != [r.token_ids for r in reseeded]


def test_empty_batch() -> None:
    result = sample(torch.empty(0, VOCAB), [], torch.Generator())
    assert result.token_ids == [] and result.logprobs == []


def test_the_fast_argmax_picks_what_argmax_picks_on_ties_and_nan() -> None:
    """The greedy pick, torch's max(-1) and (float32) the C kernel, against argmax(-1)."""
    from kvpilot.engine.cpu import layer_ops
    from kvpilot.engine.cpu.build import load_library
    from kvpilot.engine.model.layers import argmax_rows

    lib = load_library()
    gen = torch.Generator().manual_seed(3)
    tied = torch.randint(0, 4, (16, 4096), generator=gen).float()  # many maxima per row
    tied[3, 100] = tied[3, 900] = 10.0
    with_nan = torch.randn(4, 64, generator=gen)
    with_nan[1, 40] = with_nan[1, 20] = float("nan")
    picks = [argmax_rows] + ([] if lib is None else [lambda v: layer_ops.argmax_rows(lib, v)])
    for pick in picks:
        for values in (tied, tied.to(torch.bfloat16), with_nan):
            assert torch.equal(pick(values), values.argmax(-1))
        assert pick(tied)[3] == 100 and pick(with_nan)[1] == 20


def test_inverse_cdf_never_picks_a_zero_probability_token() -> None:
    from kvpilot.engine.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0]] * 4)
    # The lowest and highest uniforms float32 has, and two in between.
    uniforms = torch.tensor(
        [0.0, 0.25, 0.5, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))]
    )
    assert inverse_cdf(probs, uniforms).tolist() == [1, 1, 3, 3]
    # Rounding that leaves the total above or below 1 changes nothing at the ends.
    assert inverse_cdf(probs * 1.0000001, uniforms).tolist() == [1, 1, 3, 3]
    assert inverse_cdf(probs * 0.9999999, uniforms).tolist() == [1, 1, 3, 3]


def test_inverse_cdf_draws_from_the_distribution() -> None:
    from kvpilot.engine.sampler import inverse_cdf

    p = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4])
    n = 200_000
    uniforms = torch.rand(n, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(inverse_cdf(p.expand(n, -1), uniforms), minlength=5)
    # Each frequency within 5 standard deviations of its probability (sd <= 0.0012 here).
    assert torch.allclose(counts / n, p, atol=0.006)
    assert counts[1] == 0


@pytest.mark.parametrize("vocab", [1024, 3000, 5 * 1024 + 7])
def test_inverse_cdf_two_levels_match_one_full_scan(vocab: int) -> None:
    """The blocked search picks what one cumulative sum over the whole row picks, with zeros
    (filtered tokens) scattered over blocks, whole zero blocks, and the uniforms' extremes."""
    from kvpilot.engine.sampler import inverse_cdf

    gen = torch.Generator().manual_seed(vocab)
    rows = 400
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[torch.rand(rows, vocab, generator=gen) < 0.3] = float("-inf")
    logits[:, 1024 : 2 * 1024] = float("-inf")  # one block (where it exists) with no mass at all
    logits[::7, :-1] = float("-inf")  # rows whose only token is the last one
    logits[::7, -1] = 0.0
    probs = logits.softmax(-1)
    uniforms = torch.rand(rows, generator=gen)
    uniforms[:3] = torch.tensor(
        [0.0, 0.5, float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))]
    )
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(uniforms.unsqueeze(1) * total, torch.nextafter(total, torch.tensor(0.0)))
    expected = (cdf <= target).sum(-1)
    picked = inverse_cdf(probs, uniforms)
    assert torch.equal(picked, expected)
    assert bool((probs.gather(1, picked.unsqueeze(1)) > 0).all())


def test_filter_logits_skips_the_copy_when_nothing_applies() -> None:
    logits = random_logits(5)[:4]
    plain = [sp(temperature=1.0)] * 4
    assert filter_logits(logits, plain) is logits
    # One row with anything to do: the full path, which leaves the caller's tensor alone.
    before = logits.clone()
    mixed = filter_logits(logits, [*plain[:3], sp(temperature=1.0, top_k=3)])
    assert mixed is not logits and torch.equal(logits, before)
    assert torch.equal(mixed[:3], logits[:3])
    assert int((mixed[3] > float("-inf")).sum()) <= 3 + 2  # top 3, ties included


@pytest.mark.parametrize("vocab", [2048, 20000])
def test_top_p_candidates_match_a_full_sort(vocab: int) -> None:
    """Rows whose top-p set fits the candidates (peaked rows, rows top-k cut short, ties at the
    candidates' edge) and rows that need the full sort (flat rows, top_p near 1), against the
    per-row stable full sort. 20000 reaches the second, 4096-token round."""
    gen = torch.Generator().manual_seed(vocab)
    params, rows = [], []
    for i in range(48):
        row = torch.randn(vocab, generator=gen) * (0.5 if i % 4 == 0 else 3.0)  # some flat
        if i % 4 == 1:  # peaked: a few dozen plausible tokens
            row[torch.randperm(vocab, generator=gen)[:40]] += 12.0
        if i % 4 == 2:  # many tokens tied at values straddling the candidates' edge
            row = torch.randint(0, 6, (vocab,), generator=gen).float()
        rows.append(row)
        q = (0.05, 0.5, 0.9, 0.95, 0.99, 0.99999)[i % 6]
        params.append(
            sp(top_p=q, top_k=(0, 0, 50, 300, 3000)[i % 5], temperature=(1.0, 0.7)[i % 2])
        )
    logits = torch.stack(rows)
    expected = torch.stack(
        [reference_filter_logits(logits[i], p, stable_sort=True) for i, p in enumerate(params)]
    )
    assert torch.equal(filter_logits(logits, params), expected)
