"""Tensor parallelism: how a model splits across ranks (sharding.py), the collectives between
them (group.py), and the worker processes that hold ranks 1..N-1 (workers.py, worker.py)."""
