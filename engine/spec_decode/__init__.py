"""Speculative decoding: proposals (proposer.py: n-gram lookup in ngram.py, a draft model in
draft_model.py with its KV cache in draft_cache.py; a request's prediction first, prediction.py),
when to make them (policy.py), and their verification against the target model's distribution
(verify.py)."""
