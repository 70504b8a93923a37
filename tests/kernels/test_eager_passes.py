"""Start-up compiles every attention pass an eager step can launch (engine/kernels/attention.py,
eager_passes and compile_passes; the engine calls them when its CUDA graphs are captured). Checked
here on the decisions themselves: random steps too big for any graph, over several head shapes,
launch only passes in the enumerated set, and compile_passes launches each of them. (That no
compile then happens on a GPU is tests/kernels/test_gpu_kernels.py's.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from kvpilot.engine.kernels import attention
from kvpilot.engine.kernels.attention import (
    CompiledPass,
    compile_passes,
    eager_passes,
    pass_tilings,
    planned_passes,
    split_count,
)
from kvpilot.engine.kernels.runtime import TritonKernel

SMS = 132


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    ((32, 8, 128), (9, 3, 64), (8, 2, 32), (14, 2, 64), (16, 1, 128), (64, 8, 256)),
    ids=("llama-8b", "smollm2", "tiny", "qwen2-0.5b", "mqa", "head-256"),
)
@pytest.mark.parametrize("max_num_seqs", (256, 2048))
def test_eager_steps_launch_only_enumerated_passes(
    num_heads: int, num_kv_heads: int, head_dim: int, max_num_seqs: int
) -> None:
    min_tokens, budget, max_model_len = 1025, 8192, 4096
    group = num_heads // num_kv_heads
    enumerated = eager_passes(
        min_tokens, max_num_seqs, max_model_len, num_kv_heads, group, head_dim, SMS
    )
    rng = np.random.default_rng(num_heads * 1000 + max_num_seqs)
    seen = set()
    for _ in range(3000):
        num_tokens = int(rng.integers(min_tokens, budget + 1))
        kind = int(rng.integers(4))  # decodes alone; chunks; chunks beside decodes; many chunks
        if kind == 0 and max_num_seqs >= num_tokens:
            query_lens = [1] * num_tokens
        else:
            decodes = int(rng.integers(0, min(max_num_seqs - 1, num_tokens - 2) + 1)) * (kind == 2)
            chunk_tokens = num_tokens - decodes
            most_chunks = min(max_num_seqs - decodes, chunk_tokens // 2)
            if chunk_tokens > most_chunks * max_model_len // 2:
                continue  # no batch the scheduler could form (chunks are <= max_model_len)
            sizes = [max_model_len + 1]
            while max(sizes) > max_model_len:  # a chunk fits the model's length
                chunks = int(rng.integers(1, most_chunks + 1))
                if kind == 3:  # as many even chunks as fit: the shortest longest chunk
                    chunks = int(rng.integers(max(1, most_chunks // 2), most_chunks + 1))
                    base, extra = divmod(chunk_tokens, chunks)
                    sizes = [base + (i < extra) for i in range(chunks)]
                    continue
                cuts = np.sort(rng.choice(np.arange(1, chunk_tokens), chunks - 1, replace=False))
                sizes = np.diff(np.concatenate(([0], cuts, [chunk_tokens]))).tolist()
            query_lens = [1] * decodes + sizes
        max_seq_len = int(rng.integers(max(query_lens), max_model_len + 1))
        launched = planned_passes(num_tokens, len(query_lens), max(query_lens), min(query_lens),
                                  max_seq_len, num_kv_heads, group, head_dim, SMS)  # fmt: skip
        for p in launched:
            assert p in enumerated, (p, num_tokens, len(query_lens), max_seq_len)
        seen.update(launched)
    assert len(seen) >= 3  # the decode pass and both chunk passes, at least


def test_few_kv_heads_split_even_eager_chunks() -> None:
    """The case a GPU run found: 2 KV heads, a 1025-token chunk alone fills 130 programs of 132
    SMs and splits in 3, while a 2048-token step of many prompts does not split: both counts are
    compiled at start."""
    passes = eager_passes(1025, 64, 4096, 2, 4, 32, SMS)
    assert {CompiledPass(16, 0, n) for n in (1, 2, 3)} <= passes
    assert split_count(1025, 1, 16, 2, 1025, 64, SMS) == 3
    assert split_count(2048, 20, 16, 2, 900, 64, SMS) == 1
    # 600 two-token chunks beside 100 decodes: the smallest chunk tile, in the set.
    assert pass_tilings(700, 2, 1, 4) == [(1, 1), (2, 2)]
    assert CompiledPass(2, 2, split_count(1300, 700, 2, 2, 40, 64, SMS)) in passes
    # The 8B shape never splits at these sizes: one variant per tiling.
    assert {p.num_splits for p in eager_passes(1025, 512, 4096, 8, 4, 128, SMS)} == {1}


def test_compile_passes_launches_each_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    launched: list[tuple[str, dict[str, Any], Any]] = []

    class Recorder:
        def __init__(self, kernel: TritonKernel) -> None:
            self.kernel = kernel

        def __getitem__(self, grid: tuple[int, ...]) -> Any:
            def launch(*args: Any, **kwargs: Any) -> None:
                launched.append((self.kernel.__name__, kwargs, args))

            return launch

    monkeypatch.setattr(TritonKernel, "on", lambda self, device: Recorder(self))
    cache = torch.zeros(4, 16, 2, 32, dtype=torch.bfloat16)
    passes = eager_passes(1025, 64, 4096, 2, 4, 32, SMS)
    compile_passes(passes, 8, cache, cache.clone())
    attention_launches = [kw for name, kw, _ in launched if name == "_paged_attention_kernel"]
    got = {CompiledPass(kw["BLOCK_Q"], kw["ROWS"], kw["NUM_SPLITS"]) for kw in attention_launches}
    assert got == passes and len(attention_launches) == len(passes)
    merges = [kw for name, kw, _ in launched if name == "_merge_splits_kernel"]
    assert sorted(kw["NUM_SPLITS"] for kw in merges) == sorted(
        p.num_splits for p in passes if p.num_splits > 1
    )
    # The block tables' row stride is the 16 CUDA steps round their tables to.
    names = attention._paged_attention_kernel.fn.__code__.co_varnames
    stride_bt = names.index("stride_bt")
    assert {args[stride_bt] for name, _, args in launched if name == "_paged_attention_kernel"} == {
        16
    }


def test_the_gpu_tests_schedule_launches_only_compiled_passes(tiny_gqa_llama_dir: Any) -> None:
    """test_gpu_kernels.py's no-compile test, its schedule replayed on the CPU: every step it
    forms that no CUDA graph of its engine (64 sequences, 2048 tokens per step) would hold
    launches attention passes that start-up compiles, on a 132-SM GPU."""
    from kvpilot.engine import LLM, SamplingParams
    from kvpilot.engine.cuda_graphs import (
        StepGraphs,
        eager_warmup_plan,
        graph_batch_sizes,
        mixed_token_sizes,
    )
    from kvpilot.engine.step_input import plan_step
    from tests.kernels.workloads import TINY_GQA_LLAMA, varied_rounds

    llm = LLM(model=str(tiny_gqa_llama_dir), load_format="dummy", dtype="float32",
              max_num_seqs=64, max_num_batched_tokens=2048, block_size=16)  # fmt: skip
    runner = llm.engine.core.runner
    graphs = StepGraphs(runner.model, runner.kv_caches, graph_batch_sizes(64),
                        mixed_token_sizes(2048), 64, 4096, 16, null_block=0,
                        capture=False)  # fmt: skip
    plan = eager_warmup_plan(graphs, 2048, 64, runner.num_blocks)
    assert plan == (1025, 0)
    heads, kv_heads = TINY_GQA_LLAMA["num_attention_heads"], TINY_GQA_LLAMA["num_key_value_heads"]
    compiled = eager_passes(plan[0], 64, 4096, kv_heads, heads // kv_heads, 32, SMS)
    eager: list[CompiledPass] = []
    launch = runner.launch

    def check_then_launch(scheduled: Any, *args: Any) -> Any:
        step = plan_step(scheduled, 16, 16)
        if graphs.shape_for(step) is None:
            lens = [b - a for a, b in zip(step.query_start, step.query_start[1:], strict=False)]
            eager.extend(planned_passes(len(step.input_ids), len(lens), max(lens), min(lens),
                                        max(step.seq_lens), kv_heads, heads // kv_heads, 32,
                                        SMS))  # fmt: skip
        return launch(scheduled, *args)

    runner.launch = check_then_launch
    for prompts, outs in varied_rounds():
        llm.generate(prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in outs])
    assert eager, "no step ran eagerly: the test would prove nothing"
    assert set(eager) <= compiled, set(eager) - compiled
    assert CompiledPass(16, 0, 1) in eager  # the pass the first GPU run compiled mid-run
