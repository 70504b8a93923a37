"""logit_bias in the batched sampler: each row gets exactly its own bias added (bit for bit what a
per-row add gives), greedy and sampling rows obey it, logprobs stay those of the raw logits."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.sampler import SamplerRow, apply_logit_bias, sample
from kvpilot.engine.sampling_params import SamplingParams

VOCAB = 64


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def row(**fields: object) -> SamplerRow:
    return SamplerRow(SamplingParams(**fields), [], None)  # type: ignore[arg-type]


def test_each_row_gets_its_own_bias_added_and_nothing_else() -> None:
    x = logits(4)
    biases = [{3: 2.5, 10: -7.0}, {}, {0: 100.0}, {63: -100.0, 3: 0.25}]
    rows = [row(logit_bias=b) for b in biases]
    out = apply_logit_bias(x, rows)
    for i, bias in enumerate(biases):
        expected = x[i].clone()
        for token, value in bias.items():
            expected[token] += value
        assert torch.equal(out[i], expected)
    assert not torch.equal(out, x)
    assert torch.equal(x, logits(4))  # the caller's logits are untouched
    plain = [row() for _ in range(4)]
    assert apply_logit_bias(x, plain) is x  # no copy when no row has a bias


def test_greedy_rows_obey_a_ban_and_a_push() -> None:
    x = logits(3, seed=1)
    best = x.argmax(-1).tolist()
    rows = [row(temperature=0.0, logit_bias={best[0]: -100.0}), row(temperature=0.0),
            row(temperature=0.0, logit_bias={7: 100.0})]  # fmt: skip
    result = sample(x, rows, torch.Generator().manual_seed(0))
    assert result.token_ids[0] != best[0]
    assert result.token_ids[0] == x[0].clone().index_fill_(0, torch.tensor(best[0]), -1e9).argmax()
    assert result.token_ids[1] == best[1]
    assert result.token_ids[2] == 7


def test_sampling_rows_never_draw_a_banned_token() -> None:
    x = logits(1, seed=2).repeat(32, 1)
    top = x[0].topk(4).indices.tolist()
    rows = [row(temperature=1.0, logit_bias={t: -100.0 for t in top}) for _ in range(32)]
    drawn = set()
    for step in range(5):
        drawn |= set(sample(x, rows, torch.Generator().manual_seed(step)).token_ids)
    assert not drawn & set(top)
    free = sample(x, [row(temperature=1.0) for _ in range(32)], torch.Generator().manual_seed(0))
    assert set(free.token_ids) & set(top)  # without the bias these tokens are drawn


def test_logprobs_are_those_of_the_raw_logits() -> None:
    x = logits(1, seed=3)
    result = sample(x, [row(temperature=0.0, logprobs=2, logit_bias={5: 100.0})], torch.Generator())
    assert result.token_ids == [5]
    raw = torch.log_softmax(x[0], -1)
    assert result.logprobs[0] is not None
    assert result.logprobs[0][0] == pytest.approx(raw[5].item(), abs=1e-6)


@pytest.mark.parametrize("bias", [{1: 100.5}, {1: -101}, {-1: 1.0}, [(1, 1.0), (1, 2.0)]], ids=str)
def test_sampling_params_refuse_bad_biases(bias: object) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
