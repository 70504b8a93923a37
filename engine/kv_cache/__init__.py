"""The KV cache: where each sequence's keys and values live, which blocks hold what, and what the
outside is told about it.

- `base.py`: the contracts. `KVCachePool` is the device memory (layout, dtype, where it lives);
  `PrefixCache` is the index of reusable full blocks (keys with the request's salt, matching,
  publishing, eviction, events). A new KV dtype or a host-memory tier is a new class behind one of
  them.
- `block_pool.py`: the blocks' ref counts and the free queue, whose order is the eviction order.
- `prefix_cache.py`: chained block hashes over the pool's blocks (`HashPrefixCache`).
- `block_manager.py`: what the scheduler calls: allocation per sequence, over both of the above.
- `budget.py`: how many blocks a memory budget holds.
- `pool.py`: the per-layer K and V tensors (`PagedKVPool`; `Fp8KVPool` with its scales).
- `kv_scales.py`: an FP8 pool's scales, from the checkpoint or a calibration pass at load.
- `scales_cache.py`: calibrated scales kept in the model cache for the next start.

Everything but `pool.py`, `kv_scales.py` and `scales_cache.py` is plain Python (no torch), so
tests assert exact block ids and ref counts. The hash of a block and the event stream's wire
format are shared with the router, so they live in the contract (kvpilot.contract).
"""
