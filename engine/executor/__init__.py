"""The processes of a tensor-parallel engine: rank 0 starts the other ranks (launch.py,
workers.py), each of which runs a model runner of its own (worker.py), and sends them every step
(messages.py). Above the model runner; the model's own sharding is kvpilot.engine.parallel."""
