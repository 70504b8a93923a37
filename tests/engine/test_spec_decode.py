"""N-gram speculative decoding (engine/spec_decode/): the flag's JSON, the proposer, the rejection
sampler against the target distribution, and on the real SmolLM2 engine: greedy outputs token for
token those of decoding without speculation (concurrent requests, chunked prefill, prefix-cache
hits, preemption), stops and max_tokens inside an accepted run, the back-off and the counters."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvpilot.contract.engine_flags import FlagError
from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import SpeculativeConfig
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.server.from_flags import engine_config, parse_flags
from kvpilot.engine.server.metrics import EngineCounters, ServerMetrics
from kvpilot.engine.spec_decode.ngram import NgramProposer, propose_ngram
from kvpilot.engine.spec_decode.policy import PROBE_EVERY, SpeculationPolicy
from kvpilot.engine.spec_decode.prediction import (
    propose_from_prediction,
    propose_with_predictions,
)
from kvpilot.engine.spec_decode.verify import greedy_accept, rejection_sample

# ---- the flag --------------------------------------------------------------------------------


def test_the_flag_takes_vllms_json() -> None:
    args = parse_flags(
        [
            "--speculative-config",
            '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, '
            '"prompt_lookup_min": 2}',
        ]
    )
    spec = engine_config(args).speculative
    assert spec == SpeculativeConfig(
        num_speculative_tokens=3, prompt_lookup_max=5, prompt_lookup_min=2
    )
    assert engine_config(parse_flags([])).speculative is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("{ngram", "speculative config is not valid JSON"),
        ("[1, 2]", "speculative config must be a JSON object"),
        (
            '{"method": "eagle"}',
            "speculative method must be one of ngram, draft_model, got 'eagle'",
        ),
        ('{"speculative_model": "x"}', "speculative config has unknown keys ['speculative_model']"),
        ('{"method": "ngram", "model": "x"}', "speculative method ngram takes no draft model"),
        ('{"method": "draft_model"}', 'speculative method draft_model needs a "model"'),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer >= 1"),
        (
            '{"prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "prompt_lookup_min (5) must be <= prompt_lookup_max (3)",
        ),
        ('{"min_acceptance": 2}', "min_acceptance must be in [0, 1], got 2"),
    ],
)
def test_a_bad_speculative_config_is_a_flag_error(value: str, message: str) -> None:
    with pytest.raises(FlagError) as caught:
        parse_flags(["--speculative-config", value])
    assert message in str(caught.value)


def test_async_scheduling_is_refused_with_speculation() -> None:
    with pytest.raises(FlagError, match="async scheduling does not run with speculative"):
        parse_flags(["--async-scheduling", "--speculative-config", "{}"])


# ---- proposals and verification ----------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence_of_the_suffix() -> None:
    ids = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    # Suffix [1, 2, 3] occurred at 0 and 5: the latest (5) was followed by 5, 6, 7.
    assert propose_ngram(ids, min_n=2, max_n=3, num_tokens=3) == [5, 6, 7]
    assert propose_ngram(ids, min_n=2, max_n=3, num_tokens=10) == [5, 6, 7, 1, 2, 3]
    # Only the shortest suffix recurs: [8, 2] never occurred, [2] did (followed by 3).
    assert propose_ngram([2, 3, 8, 2], min_n=1, max_n=2, num_tokens=2) == [3, 8]
    assert propose_ngram([2, 3, 8, 2], min_n=2, max_n=2, num_tokens=2) == []
    assert propose_ngram([7], min_n=1, max_n=3, num_tokens=2) == []


def test_a_prediction_is_proposed_from_where_the_output_stands_in_it() -> None:
    """OpenAI's Predicted Outputs: the output's suffix looked up in the prediction, the occurrence
    ending nearest the output's length taken (the later one on a tie), what follows proposed."""
    prediction = [10, 11, 12, 13, 14, 15]
    sizes = {"min_n": 1, "max_n": 3, "num_tokens": 3}
    assert propose_from_prediction([10, 11], prediction, **sizes) == [12, 13, 14]
    assert propose_from_prediction([10, 11, 12, 13, 14], prediction, **sizes) == [15]
    # The output inserted a token (99): its suffix still finds its place.
    assert propose_from_prediction([10, 99, 11], prediction, **sizes) == [12, 13, 14]
    # A repeated token (5 at 0, 2, 4): the occurrence ending nearest the output's 4 tokens; of
    # ends 3 and 5, both 1 away, the later one.
    assert propose_from_prediction([7, 7, 7, 5], [5, 1, 5, 2, 5, 3], **sizes) == [3]
    assert propose_from_prediction([5], [5, 1, 5, 2, 5, 3], **sizes) == [1, 5, 2]
    # The longest suffix that occurs wins over a nearer shorter one.
    assert propose_from_prediction([1, 2], [2, 9, 1, 2, 8], **sizes) == [8]
    assert propose_from_prediction([42], prediction, **sizes) == []
    assert propose_from_prediction([10], [], **sizes) == []
    # Shorter than the shortest n-gram: proposed what follows where the prediction starts so.
    assert propose_from_prediction([10, 11], prediction, min_n=3, max_n=3, num_tokens=3) == [
        12, 13, 14,
    ]  # fmt: skip
    assert propose_from_prediction([11], prediction, min_n=2, max_n=3, num_tokens=3) == []


def test_the_prediction_is_looked_in_first_then_the_method_asked_for_the_rest() -> None:
    asked: list[list[str]] = []

    class Recording(NgramProposer):
        def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
            asked.append([seq.request_id for seq in seqs])
            return super().propose(seqs, num_tokens)

    proposer = Recording(min_n=1, max_n=2)
    prompt = [1, 2, 3, 1]  # its own lookup proposes [2, 3] after the last 1
    own = Sequence("r", 0, [*prompt, 2], num_prompt_tokens=4, params=SamplingParams())
    predicted = Sequence(
        "p", 0, [*prompt, 2], num_prompt_tokens=4,
        params=SamplingParams(prediction_token_ids=(2, 7, 8)),
    )  # fmt: skip
    unmatched = Sequence(
        "u", 0, [*prompt, 2], num_prompt_tokens=4,
        params=SamplingParams(prediction_token_ids=(5, 6)),
    )  # fmt: skip
    got = propose_with_predictions(
        proposer, [own, predicted, unmatched], [2, 2, 2], min_n=1, max_n=2
    )
    assert got == [[3, 1], [7, 8], [3, 1]]
    assert asked == [["r", "u"]]  # once, for the sequences the prediction did not serve


def test_greedy_accepts_the_proposals_the_target_argmax_agrees_with() -> None:
    assert greedy_accept([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all and the bonus token
    assert greedy_accept([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # the correction at the first miss
    assert greedy_accept([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert greedy_accept([4], []) == [4]


# chi-square critical values at significance 0.001 by degrees of freedom: a correct sampler fails
# one run in a thousand, a wrong one (tested below) by orders of magnitude.
CHI2_CRITICAL_0_001 = {4: 18.47, 5: 20.52}


def chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_rejection_sampling_follows_the_target_distribution() -> None:
    """Drafts of a one-hot proposal, accepted with p(d) and otherwise redrawn from p without d:
    each emitted token follows the target distribution, whatever the draft."""
    probs = torch.tensor(
        [
            [0.05, 0.40, 0.10, 0.25, 0.15, 0.05],  # the draft (token 3) is likely-ish
            [0.30, 0.05, 0.20, 0.10, 0.05, 0.30],  # the draft (token 1) is unlikely
            [0.10, 0.10, 0.30, 0.20, 0.20, 0.10],  # the bonus position
        ]
    )
    drafts = [3, 1]
    generator = torch.Generator().manual_seed(1234)
    num_draws = 5000
    first = [0] * 6
    second = [0] * 6  # given that the first draft was accepted
    third = [0] * 6  # given that both were accepted
    lengths = [0, 0, 0]
    for _ in range(num_draws):
        uniforms = torch.rand(3, generator=generator)
        out = rejection_sample(probs, drafts, uniforms)
        lengths[len(out) - 1] += 1
        first[out[0]] += 1
        if out[0] == drafts[0] and len(out) > 1:
            second[out[1]] += 1
        if len(out) == 3:
            third[out[2]] += 1
    critical = CHI2_CRITICAL_0_001[5]
    assert chi_square(first, probs[0].tolist()) < critical
    assert chi_square(second, probs[1].tolist()) < critical
    assert chi_square(third, probs[2].tolist()) < critical
    # Acceptance happens at the rate p(d): 0.25 for the first draft, then 0.05.
    assert lengths[0] / num_draws == pytest.approx(0.75, abs=0.02)
    assert lengths[2] / num_draws == pytest.approx(0.25 * 0.05, abs=0.006)
    # The test can fail: a sampler that always kept the draft's token would be far off.
    wrong = [0] * 6
    wrong[3] = num_draws
    assert chi_square(wrong, probs[0].tolist()) > 100 * critical


# ---- the real engine ---------------------------------------------------------------------------

TEXT = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the reading room, the children's corner and the "
    "archive, but postponed the decision on the roof garden until the spring meeting."
)
TASKS = [
    f"Repeat this text exactly: {TEXT}",
    f"Copy the following paragraph word for word: {TEXT}",
    f"Rewrite this text, replacing 'committee' with 'council': {TEXT}",
    f"Repeat the first sentence of this text twice: {TEXT}",
]
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
# Chunked prefill (a 64-token budget cuts every prompt and the verify queries), and a pool that
# four concurrent sequences outgrow (preemption); the prefix cache is on.
SETUP = {"dtype": "float32", "max_num_batched_tokens": 64, "num_blocks": 28, "block_size": 16}


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    return {spec: LLM(speculative=SPEC if spec else None, **SETUP) for spec in (False, True)}


GREEDY = SamplingParams(temperature=0.0, max_tokens=40)


@pytest.fixture(scope="module")
def plain(engines: dict[bool, LLM]) -> list[tuple[list[int], str, str | None]]:
    """The greedy outputs without speculation."""
    return run(engines[False], GREEDY)


def prompts(llm: LLM, tasks: list[str]) -> list[str]:
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": task}], add_generation_prompt=True, tokenize=False
        )
        for task in tasks
    ]


def run(
    llm: LLM, params: SamplingParams, tasks: list[str] = TASKS
) -> list[tuple[list[int], str, str | None]]:
    outs = llm.generate(prompts(llm, tasks), params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_greedy_outputs_are_those_without_speculation(
    engines: dict[bool, LLM], plain: list[tuple[list[int], str, str | None]]
) -> None:
    spec_llm = engines[True]
    core = spec_llm.engine.core
    assert core.speculation is not None
    hits_before = spec_llm.engine.block_manager.num_hit_tokens
    # Twice: the second pass finds the prompts in the prefix cache.
    assert run(spec_llm, GREEDY) == plain
    assert run(spec_llm, GREEDY) == plain
    counters = core.speculation.counters
    # Input-grounded prompts: most proposals are accepted.
    assert counters.num_accepted_tokens > 80
    assert counters.num_accepted_tokens > 0.5 * counters.num_draft_tokens
    assert sum(counters.accepted_per_pos) == counters.num_accepted_tokens
    assert counters.accepted_per_pos == sorted(counters.accepted_per_pos, reverse=True)
    assert spec_llm.engine.block_manager.num_hit_tokens > hits_before
    assert core.scheduler.num_preemptions > 0
    assert not core.has_unfinished_requests()
    assert spec_llm.engine.block_manager.usage == 0.0
    spec_llm.engine.block_manager.check_integrity([])


def test_stops_and_max_tokens_inside_an_accepted_run_end_at_their_token(
    engines: dict[bool, LLM], plain: list[tuple[list[int], str, str | None]]
) -> None:
    tokens, text, _ = plain[0]
    # A token and a word deep in the copied text, where whole runs of proposals are accepted.
    stop_token = tokens[30]
    stop_word = "reading"
    assert stop_word in text
    llm = engines[True]
    accepted_before = llm.engine.core.speculation.counters.num_accepted_tokens
    two = TASKS[:2]
    by_token = run(
        llm, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token]), two
    )
    assert by_token[0] == (tokens[: tokens.index(stop_token) + 1], by_token[0][1], "stop")
    by_word = run(llm, SamplingParams(temperature=0.0, max_tokens=40, stop=[stop_word]), two)
    assert by_word[0][1] == text[: text.index(stop_word)] and by_word[0][2] == "stop"
    by_length = run(llm, SamplingParams(temperature=0.0, max_tokens=23), two)
    assert [out[0] for out in by_length] == [t[:23] for t, _, _ in plain[:2]]
    assert all(out[2] == "length" for out in by_length)
    assert llm.engine.core.speculation.counters.num_accepted_tokens > accepted_before + 30


def test_sampled_requests_speculate_and_keep_their_seeds(engines: dict[bool, LLM]) -> None:
    llm = engines[True]
    counters = llm.engine.core.speculation.counters
    before = counters.num_drafts
    params = SamplingParams(temperature=0.7, top_p=0.95, seed=7, max_tokens=24)
    first = run(llm, params, TASKS[:2])
    assert counters.num_drafts > before
    assert run(llm, params, TASKS[:2]) == first  # a seeded request gives the same tokens again
    assert all(len(t) > 0 for t, _, _ in first)


def test_a_prediction_is_accepted_where_the_prompt_has_no_answer_and_changes_no_token(
    engines: dict[bool, LLM],
) -> None:
    """A chat whose answer its prompt does not hold. With that answer (the engine's without
    speculation) as the prediction, most of it is accepted, far more than the sequence's own
    lookup finds; with another answer as the prediction, or none, the greedy tokens are the
    same."""
    tasks = ["Write two sentences about a lighthouse keeper.", "Name three kinds of apples."]
    params = SamplingParams(temperature=0.0, max_tokens=40)
    (answer, _, _), (other, _, _) = run(engines[False], params, tasks)
    llm = engines[True]
    counters = llm.engine.core.speculation.counters

    def generate(prediction: list[int]) -> tuple[list[int], int]:
        before = counters.num_accepted_tokens
        with_prediction = dataclasses.replace(params, prediction_token_ids=tuple(prediction))
        ((tokens, _, _),) = run(llm, with_prediction, tasks[:1])
        return tokens, counters.num_accepted_tokens - before

    predicted, accepted_predicted = generate(answer)
    wrong, _ = generate(other)
    unpredicted, accepted_own = generate([])
    assert predicted == wrong == unpredicted == answer
    assert accepted_predicted >= 0.7 * len(answer), (accepted_predicted, len(answer))
    assert accepted_predicted > accepted_own + 10, (accepted_predicted, accepted_own)


def decoding_seq() -> Sequence:
    """A sequence past its prompt whose suffix recurs: the proposer always has proposals."""
    ids = [1, 2, 3, 4] * 3
    seq = Sequence("r", 0, ids, num_prompt_tokens=len(ids) - 1, params=SamplingParams())
    seq.num_computed_tokens = len(ids) - 1
    return seq


def test_speculation_backs_off_in_large_batches_and_at_low_acceptance() -> None:
    policy = SpeculationPolicy(SpeculativeConfig(disable_by_batch_size=2), max_seq_len=4096)
    seqs = [decoding_seq() for _ in range(2)]
    policy.propose(seqs)
    assert [s.spec_token_ids for s in seqs] == [[1, 2, 3, 4]] * 2
    # Three running sequences: past the batch size, none gets proposals.
    seqs.append(decoding_seq())
    policy.propose(seqs)
    assert all(s.spec_token_ids == [] for s in seqs)
    # Acceptance measured near zero: only every PROBE_EVERY-th step proposes.
    for _ in range(40):
        policy.record([(decoding_seq(), 4, 0)])
    assert policy.acceptance < policy.config.min_acceptance
    proposing_steps = 0
    for _ in range(PROBE_EVERY * 2):
        seq = decoding_seq()
        policy.propose([seq])
        proposing_steps += bool(seq.spec_token_ids)
    assert proposing_steps == 2
    # Proposals never reach past max_tokens: one output token left, so none at all.
    seq = decoding_seq()
    seq.params = SamplingParams(max_tokens=3)  # 1 generated, 2 left: 1 proposal at most
    SpeculationPolicy(SpeculativeConfig(), max_seq_len=4096).propose([seq])
    assert seq.spec_token_ids == [1]


def test_each_sequence_backs_off_on_its_own_acceptance() -> None:
    """One sequence's rejected proposals back it off alone: another keeps proposing. A new
    sequence starts from the engine's acceptance over all of them, one with a prediction from
    full confidence."""
    policy = SpeculationPolicy(SpeculativeConfig(), max_seq_len=4096)
    missing, copying = decoding_seq(), decoding_seq()
    for _ in range(30):
        policy.propose([missing, copying])
        policy.record([(missing, 4, 0), (copying, 4, 4)])
    assert policy.acceptance_of(missing) < policy.config.min_acceptance
    assert policy.acceptance_of(copying) > 0.9
    proposed = {"missing": 0, "copying": 0}
    for _ in range(PROBE_EVERY * 2):
        policy.propose([missing, copying])
        proposed["missing"] += bool(missing.spec_token_ids)
        proposed["copying"] += bool(copying.spec_token_ids)
    assert proposed == {"missing": 2, "copying": PROBE_EVERY * 2}  # the first: its probes alone
    # The engine's acceptance (half of all proposals accepted) is where a new sequence starts.
    assert policy.acceptance_of(decoding_seq()) == pytest.approx(0.5, abs=0.05)
    # Every proposal missing for a while: a new sequence is backed off from its first step, one
    # with a prediction is not.
    for _ in range(40):
        policy.record([(decoding_seq(), 4, 0)])
    plain, predicted = decoding_seq(), decoding_seq()
    predicted.params = SamplingParams(prediction_token_ids=(9, 9))
    policy.propose([plain, predicted])
    if policy.num_steps % PROBE_EVERY == 0:  # a probe step proposes for all: take the next
        policy.propose([plain, predicted])
    # (The prediction has no match: its proposals come from its own tokens.)
    assert plain.spec_token_ids == [] and predicted.spec_token_ids == [1, 2, 3, 4]
    # Sequences no longer running are forgotten.
    policy.propose([plain])
    assert set(policy.seq_acceptance) <= {plain.seq_id}


class CountingNgram(NgramProposer):
    """The n-gram proposer, counting the sequences it is asked about (a draft model's cost)."""

    def __init__(self) -> None:
        super().__init__(min_n=2, max_n=4)
        self.num_asked = 0

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        self.num_asked += len(seqs)
        return super().propose(seqs, num_tokens)


def test_at_batch_64_the_default_config_never_speculates_nor_pays_for_proposals() -> None:
    """The issue's 'never slower at 64': with vLLM's default shape of the config, 64 running
    sequences get no proposals in any step (probe steps included), so each decodes one token a
    step as without speculation, and the proposer is not even asked; once the batch is back
    within disable_by_batch_size, speculation resumes by itself."""
    config = SpeculativeConfig()
    assert config.disable_by_batch_size < 64
    proposer = CountingNgram()
    policy = SpeculationPolicy(config, max_seq_len=4096, proposer=proposer)
    batch = [decoding_seq() for _ in range(64)]
    for _ in range(PROBE_EVERY * 2):
        policy.propose(batch)
        assert all(seq.spec_token_ids == [] for seq in batch)
    assert proposer.num_asked == 0
    small = batch[: config.disable_by_batch_size]
    policy.propose(small)
    assert [seq.spec_token_ids for seq in small] == [[1, 2, 3, 4]] * len(small)
    assert proposer.num_asked == len(small)


def test_the_counters_reach_vllms_metric_names() -> None:
    registry = CollectorRegistry()
    metrics = ServerMetrics(
        registry,
        "m",
        block_size=16,
        num_gpu_blocks=100,
        enable_prefix_caching=True,
        max_model_len=2048,
        num_speculative_tokens=3,
    )
    metrics.record_counters(
        EngineCounters(
            spec_num_drafts=5,
            spec_num_draft_tokens=15,
            spec_num_accepted_tokens=9,
            spec_accepted_per_pos=(5, 3, 1),
        )
    )
    metrics.record_counters(
        EngineCounters(
            spec_num_drafts=6,
            spec_num_draft_tokens=18,
            spec_num_accepted_tokens=11,
            spec_accepted_per_pos=(6, 4, 1),
        )
    )

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})

    assert value("vllm:spec_decode_num_drafts_total") == 6
    assert value("vllm:spec_decode_num_draft_tokens_total") == 18
    assert value("vllm:spec_decode_num_accepted_tokens_total") == 11
    per_pos = [
        value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p))
        for p in range(3)
    ]
    assert per_pos == [6, 4, 1]
    without = CollectorRegistry()
    ServerMetrics(
        without, "m", block_size=16, num_gpu_blocks=1, enable_prefix_caching=True, max_model_len=8
    )
    assert (
        without.get_sample_value(
            "vllm:spec_decode_num_drafts_total", {"model_name": "m", "engine": "0"}
        )
        is None
    )
