"""One step's model input as plain integers: what the scheduler decided, before any tensor.

The model runner turns it into tensors; under tensor parallelism rank 0 also sends it, as msgpack,
to every other rank, which then runs the same forward pass on its shard (the scheduler and the
block tables live on rank 0 only).
"""

from __future__ import annotations

import msgspec

from kvpilot.engine.scheduler import ScheduledSequence

# What CUDA steps round their block tables' width up to (plan_step's table_width_multiple).
CUDA_TABLE_WIDTH_MULTIPLE = 16


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class StepInput(msgspec.Struct, array_like=True, gc=False, tag=True):
    input_ids: list[int]  # [T]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]: block_id * block_size + offset
    query_start: list[int]  # [S + 1]
    seq_lens: list[int]  # [S]
    block_tables: list[list[int]]  # [S, max_blocks], padded with 0
    # Flat index of each sampling sequence's last token; of its last k+1 with k proposals.
    logits_indices: list[int]
    # [S]: each sequence's LoRA adapter slot, -1 for the base model; empty when none has one.
    lora_slots: list[int] = []
    # Slots to fill before this step's forward: (slot, adapter name, adapter path); the other
    # tensor-parallel ranks read the adapter from the path.
    lora_fills: list[tuple[int, str, str]] = []


def plan_step(
    scheduled: list[ScheduledSequence], block_size: int, table_width_multiple: int = 1
) -> StepInput:
    """table_width_multiple: the block tables' width is rounded up to it (CUDA: 16, so that the
    tables' row stride, a kernel argument, is always a multiple of 16, the class the CUDA graphs'
    tables have, and an eager step never makes Triton compile another attention variant)."""
    bs = block_size
    step = StepInput([], [], [], [0], [], [], [])
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        table = seq.block_table
        if end - start == 1:  # a decode (most rows of most steps): no ranges to build
            step.input_ids.append(seq.token_ids[start])
            step.positions.append(start)
            step.slot_mapping.append(table[start // bs] * bs + start % bs)
        else:
            num_spec = item.num_spec_tokens
            step.input_ids.extend(seq.token_ids[start : end - num_spec])
            if num_spec:
                step.input_ids.extend(seq.spec_token_ids[:num_spec])
            step.positions.extend(range(start, end))
            step.slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        step.query_start.append(step.query_start[-1] + item.num_new_tokens)
        step.seq_lens.append(end)
        if item.will_sample:
            # One row per verified position: the last known token's and each proposal's.
            last = step.query_start[-1] - 1
            step.logits_indices.extend(range(last - item.num_spec_tokens, last + 1))
    if any(item.seq.lora_name is not None for item in scheduled):
        step.lora_slots.extend(item.seq.lora_slot for item in scheduled)
    max_blocks = max(len(item.seq.block_table) for item in scheduled)
    max_blocks = round_up(max_blocks, table_width_multiple)
    step.block_tables.extend(
        item.seq.block_table + [0] * (max_blocks - len(item.seq.block_table)) for item in scheduled
    )
    return step
