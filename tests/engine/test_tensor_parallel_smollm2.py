"""The bundled SmolLM2-135M (9 query heads, 3 KV heads, tied embeddings) split over 3 ranks on CPU:
greedy parity with the same engine at TP=1, token for token, logprobs within LOGPROB_ATOL (float32;
the all-reduced partial sums differ from one matmul only in summation order)."""

from __future__ import annotations

from kvpilot.engine import LLM, SamplingParams

from .reference import CHAT_QUESTIONS

MAX_TOKENS = 6
LOGPROB_ATOL = 1e-3


def test_smollm2_tp3_greedy_parity_with_tp1() -> None:
    conversations = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[1:3]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, ignore_eos=True)
    results = {}
    for tp in (1, 3):
        with LLM(dtype="float32", tensor_parallel_size=tp, kv_cache_gib=0.05) as llm:
            results[tp] = [o.outputs[0] for o in llm.chat(conversations, params)]
            if tp == 3:
                assert llm.engine.core.description.tensor_parallel_size == 3
                bytes_per_rank = llm.engine.runner.rank_bytes_loaded
                total = llm.engine.model_config.num_params * 4  # float32, tied embeddings
    for ours, ref in zip(results[3], results[1], strict=True):
        assert ours.token_ids == ref.token_ids
        assert len(ours.token_ids) == MAX_TOKENS
        for step in range(MAX_TOKENS):
            for token, ref_lp in ref.logprobs[step].items():
                assert abs(ours.logprobs[step][token].logprob - ref_lp.logprob) < LOGPROB_ATOL
    # Each rank read about a third of the weights (the norms, ~0.03%, on every rank).
    assert all(0.33 < b / total < 0.34 for b in bytes_per_rank), bytes_per_rank
