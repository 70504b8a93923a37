"""Tensor parallelism's arithmetic and collectives, which the model is built with: how a model
splits across ranks (sharding.py) and the collectives between them (group.py). The processes that
hold the other ranks are the executor's (kvpilot.engine.executor)."""
