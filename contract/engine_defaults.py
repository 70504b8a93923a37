"""The engine's defaults that the operator must agree with: a spec that leaves an engine setting
out gets these from `kvpilot serve`, and the operator sizes and checks the pod for the same
values. Torch-free and import-free, so that both sides (and the operator's image, without torch)
read them.
"""

from __future__ import annotations

# The scheduler: sequences and tokens one step may hold (--max-num-seqs, --max-num-batched-tokens).
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# First come, first served, as vLLM (--scheduling-policy); a request's `priority` then must be 0.
DEFAULT_SCHEDULING_POLICY = "fcfs"
# The priority policy's guard (SchedulerConfig; --priority-guard-*): a few seconds covers a
# tenant's steady traffic between its requests. What a better request arriving mid-step waits for
# beyond its own class's work is the worse tokens in that step, and on a CPU a step costs per
# token, prompt tokens and decodes alike (bench/step_cost.py: SmolLM2, float32, one thread, a step
# of 32 tokens ~3.4x one of 1, of 8 ~1.6x, of 4 ~1.3x). 4 worse tokens keep a premium chat's p99
# time to first token within 1.2x of its time alone (bench/RESULTS.md "Tenants"); a few sequences
# let worse decodes go on beside the better ones, and their prompts still start, 4 tokens a step.
DEFAULT_GUARD_WINDOW_S = 2.0
DEFAULT_GUARD_STEP_SEQS = 4
DEFAULT_GUARD_STEP_TOKENS = 4
# The KV-cache budget on CPU when none is given (--kv-cache-gib).
DEFAULT_KV_CACHE_GIB = 1.0
DEFAULT_KV_CACHE_BYTES = int(DEFAULT_KV_CACHE_GIB * 2**30)
# Bytes per element of each dtype the engine takes by name (--dtype).
DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}
# What --dtype auto resolves to on each device type: full precision where the CPU computes it
# natively, bfloat16 on GPUs.
AUTO_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
