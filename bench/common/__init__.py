"""What the benchmark scripts share: the synthetic serving workload (dataset), the streaming load
generator and its request results (client, stream_client), percentiles and ratios (stats), server
and worker processes (processes, offline_workers), the kvpilot-vs-vLLM comparison (peer),
figures (plotting) and the profiled router that router_chat.py --profile starts (router_profile).

bench/ is no package: each script puts its own folder first on sys.path, so `common` imports the
same way from `python bench/X.py` and from the tests that load a script by path.
"""
