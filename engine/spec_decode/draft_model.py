"""Draft-model proposals: a smaller model of the target's vocabulary proposes k tokens greedily,
for every speculating sequence at once.

Each step the draft runs one forward over every speculating sequence's tokens it has not seen yet
(the prompt the first time, else the tokens the target took last step), whose last rows give the
first proposals, then k - 1 one-token forwards, the whole batch each, feeding its own proposals
back. Its KV cache is its own (draft_cache.py), sized by contract/sizing.draft_kv_tokens; its
weights and that cache are counted by the start-up memory check (draft_bytes) and, on a GPU,
left free beside the target's pool (draft_reserve). A catch-up never takes more tokens in a step
than a target step may (max_num_batched_tokens): a longer one continues in the next step, with no
proposals meanwhile.

The proposals are one token each (no distribution): verify.py treats them as n-gram ones, so
greedy outputs stay those of decoding without speculation and sampled ones follow the target's
distribution (rejection sampling with a one-hot draft).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from kvpilot.contract import sizing
from kvpilot.engine.attention import AttentionMetadata
from kvpilot.engine.config import EngineConfig, ModelConfig, SpeculativeConfig
from kvpilot.engine.host_copy import to_device
from kvpilot.engine.kv_cache.budget import DraftReserve
from kvpilot.engine.kv_cache.pool import KVLayout, PagedKVPool
from kvpilot.engine.model.llama import ForwardContext, LlamaForCausalLM
from kvpilot.engine.model.loader import (
    BUNDLED_MODEL_NAME,
    ResolvedModel,
    read_hf_config,
    resolve_model,
)
from kvpilot.engine.model_setup import load_model
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.draft_cache import DraftBlocks, DraftState
from kvpilot.engine.step_input import CUDA_TABLE_WIDTH_MULTIPLE, round_up

log = logging.getLogger("kvpilot")

BUILTIN_SCHEME = "builtin://"
# The bundled model's builtin:// name (the operator's spec.model.uri spelling).
BUILTIN_NAME = BUNDLED_MODEL_NAME.lower()


def draft_source(model: str) -> ResolvedModel:
    """The draft's files: an HF directory, a .gguf, or builtin://NAME (the bundled model)."""
    if model.startswith(BUILTIN_SCHEME):
        name = model[len(BUILTIN_SCHEME) :]
        if name != BUILTIN_NAME:
            raise ValueError(
                f"speculative model {model!r}: the bundled model is {BUILTIN_SCHEME}{BUILTIN_NAME}"
            )
        return resolve_model(None, "auto")
    return resolve_model(model, "auto")


def draft_model_config(spec: SpeculativeConfig, target: ModelConfig) -> ModelConfig:
    """The draft's shape, read from its config alone; ValueError unless its vocabulary is the
    target's (its token ids would mean other tokens)."""
    assert spec.model is not None
    draft = ModelConfig.from_hf_config(read_hf_config(draft_source(spec.model).hf_dir))
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative model {spec.model!r} has a vocabulary of {draft.vocab_size} tokens, the "
            f"target's has {target.vocab_size}: a draft model must share the target's tokenizer"
        )
    return draft


def draft_bytes(config: EngineConfig, target: ModelConfig, *, target_kv_tokens: int) -> int:
    """What config's draft model holds (contract/sizing.py): its weights and the KV pool
    DraftModelProposer sizes, for an engine whose target pool holds target_kv_tokens. Reads the
    draft's config only; ValueError as draft_model_config."""
    spec = config.speculative
    assert spec is not None and spec.method == "draft_model"
    draft = draft_model_config(spec, target)
    max_model_len = config.max_model_len or target.max_position_embeddings
    kv_tokens = sizing.draft_kv_tokens(
        target_kv_tokens=target_kv_tokens,
        # The engine's longest sequence (EngineCore.max_seq_len).
        max_seq_len=min(max_model_len, target_kv_tokens),
        max_speculating_seqs=spec.disable_by_batch_size,
        block_size=config.cache.block_size,
    )
    return sizing.draft_model_bytes(
        num_params=draft.num_params,
        num_layers=draft.num_hidden_layers,
        num_kv_heads=draft.num_key_value_heads,
        head_dim=draft.head_dim,
        itemsize=torch.empty((), dtype=config.resolved_dtype).element_size(),
        kv_tokens=kv_tokens,
    )


def draft_reserve(config: EngineConfig, target: ModelConfig, max_model_len: int) -> DraftReserve:
    """The draft's share of the target's device, for sizing the target's pool beside it: its
    weights, and its pool's bytes per token and largest size (disable_by_batch_size sequences of
    max_model_len)."""
    spec = config.speculative
    assert spec is not None and spec.method == "draft_model"
    draft = draft_model_config(spec, target)
    itemsize = torch.empty((), dtype=config.resolved_dtype).element_size()
    most = spec.disable_by_batch_size * max_model_len
    return DraftReserve(
        weight_bytes=draft.num_params * itemsize,
        kv_bytes_per_token=draft.kv_bytes_per_token * itemsize,
        max_kv_tokens=sizing.draft_kv_tokens(
            target_kv_tokens=most,
            max_seq_len=max_model_len,
            max_speculating_seqs=spec.disable_by_batch_size,
            block_size=config.cache.block_size,
        ),
    )


@dataclass
class _Row:
    """A sequence in a draft step."""

    index: int  # in propose's arguments
    state: DraftState
    start: int  # first position computed in the catch-up
    count: int  # tokens in the catch-up
    num_tokens: int  # the sequence's tokens
    k: int  # proposals to make (0: the catch-up is not finished in this step)


class DraftModelProposer:
    """The Proposer of method draft_model."""

    def __init__(
        self,
        config: EngineConfig,
        target: ModelConfig,
        device: torch.device,
        *,
        max_seq_len: int,
        target_pool_tokens: int,
    ) -> None:
        """max_seq_len: the longest sequence the engine runs; target_pool_tokens: what the
        target's KV pool holds (the draft's pool holds as many, or disable_by_batch_size longest
        sequences where that is fewer: only that many speculate at once)."""
        spec = config.speculative
        assert spec is not None and spec.model is not None
        draft = draft_model_config(spec, target)
        source = draft_source(spec.model)
        self.max_len = min(draft.max_position_embeddings, max_seq_len)
        draft_config = dataclasses.replace(
            config,
            model=spec.model,
            load_format="auto",
            lora=None,
            speculative=None,
            cache=dataclasses.replace(config.cache, kv_cache_dtype="auto"),
        )
        self.model: LlamaForCausalLM = load_model(
            draft_config, draft, source, self.max_len, device, None
        ).model
        block_size = config.cache.block_size
        tokens = sizing.draft_kv_tokens(
            target_kv_tokens=target_pool_tokens,
            max_seq_len=max_seq_len,
            max_speculating_seqs=spec.disable_by_batch_size,
            block_size=block_size,
        )
        num_blocks = tokens // block_size
        layout = KVLayout(
            draft.num_hidden_layers, self.model.shard.num_kv_heads, draft.head_dim, block_size
        )
        self.pool = PagedKVPool(layout, num_blocks, config.resolved_dtype, device)
        self.blocks = DraftBlocks(num_blocks, block_size)
        self.device = device
        self.max_batched_tokens = config.scheduler.max_num_batched_tokens
        self.table_width_multiple = CUDA_TABLE_WIDTH_MULTIPLE if device.type == "cuda" else 1
        log.info(
            "draft model %s: %d layers, KV pool of %d tokens", spec.model,
            draft.num_hidden_layers, num_blocks * block_size,
        )  # fmt: skip

    def keep_only(self, running: list[Sequence]) -> None:
        self.blocks.keep_only({seq.seq_id for seq in running})

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in seqs]
        rows = self._catch_up_rows(seqs, num_tokens)
        if not rows:
            return out
        ids = [t for r in rows for t in seqs[r.index].token_ids[r.start : r.start + r.count]]
        hidden = self._forward(
            to_device(ids, torch.int64, self.device),
            [(r.state, r.start, r.count) for r in rows],
        )
        for r in rows:
            r.state.num_computed = r.start + r.count
        proposing = [r for r in rows if r.k]
        if not proposing:
            return out
        ends, end = [], 0
        for r in rows:
            end += r.count
            if r.k:
                ends.append(end - 1)
        drafts = self._argmax(hidden[to_device(ends, torch.int64, self.device)])
        # Proposal j of every row still proposing: (the rows, in order; their tokens).
        steps = [(list(range(len(proposing))), drafts)]
        for j in range(1, max(r.k for r in proposing)):
            cols, previous = steps[-1]
            keep = [p for p, a in enumerate(cols) if proposing[a].k > j]
            if len(keep) < len(cols):
                previous = previous[to_device(keep, torch.int64, self.device)]
                cols = [cols[p] for p in keep]
            # Proposal j - 1 goes in at position num_tokens + j - 1.
            batch = [(proposing[a].state, proposing[a].num_tokens + j - 1, 1) for a in cols]
            steps.append((cols, self._argmax(self._forward(previous, batch))))
        for cols, tokens in steps:  # one wait for the device, at the end
            for a, token in zip(cols, tokens.tolist(), strict=True):
                out[proposing[a].index].append(token)
        for r in proposing:
            r.state.base = r.num_tokens
            r.state.fed = out[r.index][: r.k - 1]
        return out

    def _catch_up_rows(self, seqs: list[Sequence], num_tokens: list[int]) -> list[_Row]:
        """Each sequence's tokens the draft has not computed, within the step's token budget,
        with its blocks reserved (a sequence the pool has no room for is dropped, and gets no
        proposals)."""
        rows = []
        budget = self.max_batched_tokens
        for index, (seq, k) in enumerate(zip(seqs, num_tokens, strict=True)):
            n = seq.num_tokens
            k = min(k, self.max_len - n + 1)  # proposal k - 1 goes in at position n + k - 2
            if k < 1 or budget == 0:
                continue
            state = self.blocks.state(seq)
            state.rollback(seq.token_ids)
            # The last token always goes in: its logits give the first proposal.
            start = min(state.num_computed, n - 1)
            count = min(n - start, budget)
            done = start + count == n
            if not self.blocks.reserve(state, n + k - 1 if done else start + count):
                self.blocks.drop(seq.seq_id)
                continue
            budget -= count
            rows.append(_Row(index, state, start, count, n, k if done else 0))
        return rows

    def _argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).argmax(dim=-1)

    def _forward(
        self, input_ids: torch.Tensor, rows: list[tuple[DraftState, int, int]]
    ) -> torch.Tensor:
        """The draft's hidden states [T, hidden] for rows of (state, first position, tokens),
        their KV written into the draft's pool."""
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens = []
        for state, start, count in rows:
            positions.extend(range(start, start + count))
            slots.extend(self.blocks.slot(state, p) for p in range(start, start + count))
            query_start.append(query_start[-1] + count)
            seq_lens.append(start + count)
        width = round_up(max(len(state.blocks) for state, _, _ in rows), self.table_width_multiple)
        tables = [state.blocks + [0] * (width - len(state.blocks)) for state, _, _ in rows]
        query_lens = tuple(count for _, _, count in rows)
        meta = AttentionMetadata(
            query_start_loc=to_device(query_start, torch.int32, self.device),
            seq_lens=to_device(seq_lens, torch.int32, self.device),
            block_tables=to_device(tables, torch.int32, self.device),
            slot_mapping=to_device(slots, torch.int64, self.device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=tuple(seq_lens),
        )
        ctx = ForwardContext(
            to_device(positions, torch.int64, self.device), meta, self.pool.layers, None,
            self.pool.scales,
        )  # fmt: skip
        return self.model(input_ids, ctx)
