"""Speculative decoding: proposals (ngram.py), when to make them (policy.py), and their
verification against the target model's distribution (verify.py)."""
