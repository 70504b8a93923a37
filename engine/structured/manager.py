"""The engine core's side of structured outputs: each constrained sequence's matcher, grammar
compilation off the step loop, and the token masks of a step computed while its forward runs.

Compiling starts when a request arrives, on the compile thread, after the backend's one load (the
tokenizer's vocabulary: seconds, done on the same thread at the first constrained request); the
scheduler leaves a sequence waiting until its grammar is ready (`SequenceGrammar.is_ready`), so
the other sequences' steps never wait for the load or a slow compile. A step's masks are
filled on the mask thread while the model's forward pass runs on the step thread (torch and
xgrammar both release the interpreter lock), so a constrained step costs little more than a free
one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.structured.backend import DEFAULT_BACKEND, GrammarBackend, GrammarMatcher
from kvpilot.engine.structured.bitmask import GrammarMask, bitmask_to_bias
from kvpilot.engine.structured.registry import create_backend, to_grammar
from kvpilot.engine.structured.spec import StructuredSpec

log = logging.getLogger("kvpilot")


class SequenceGrammar:
    """One sequence's grammar state: its compiled grammar (maybe still compiling) and matcher.
    A request with n > 1 gives each sequence its own."""

    def __init__(self, backend: Future[GrammarBackend], compiled: Future[Any]) -> None:
        self._backend = backend
        self.compiled = compiled
        self._matcher: GrammarMatcher | None = None
        self.is_broken = False  # a token the grammar refused (never expected: masks forbid it)

    @property
    def is_ready(self) -> bool:
        """Compiled (or failed to): a step with this sequence will not wait for it."""
        return self.compiled.done()

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            self._matcher = self._backend.result().matcher(self.compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept(token_id):
            self.is_broken = True
            log.error("the grammar refused token %d, which its mask allowed", token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated

    def num_acceptable(self, token_ids: list[int]) -> int:
        """How many leading proposals the grammar takes from its state without ending (the
        matcher does not move)."""
        return self.matcher.num_acceptable(token_ids)

    def fill_rows(self, bitmask: torch.Tensor, first_row: int, draft_ids: list[int]) -> None:
        """bitmask rows first_row .. first_row + k: the allowed tokens after each prefix
        d_0..d_{i-1} of the k proposals (which the grammar takes: num_acceptable cut them). The
        matcher ends where it started; the emitted tokens are accepted when they are read."""
        matcher = self.matcher
        for i, token in enumerate(draft_ids):
            matcher.fill_mask(bitmask, first_row + i)
            if not matcher.accept(token):
                matcher.rollback(i)
                raise RuntimeError(f"the grammar refused proposal {token}, which it was cut to")
        matcher.fill_mask(bitmask, first_row + len(draft_ids))
        matcher.rollback(len(draft_ids))


class StructuredOutputs:
    """Created once per core; the backend (the tokenizer's vocabulary) loads on the compile thread
    at first use."""

    def __init__(
        self,
        hf_dir: Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        backend_name: str = DEFAULT_BACKEND,
        overlap: bool = True,
        backend_factory: Callable[[], GrammarBackend] | None = None,
    ) -> None:
        self.backend_name = backend_name
        self._hf_dir = hf_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._backend_factory = backend_factory or self._load_backend
        self._backend: Future[GrammarBackend] | None = None
        self.overlap = overlap
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-grammar-mask")
        self._bitmask: torch.Tensor | None = None

    def _load_backend(self) -> GrammarBackend:
        from kvpilot.engine.model.loader import eos_token_ids, load_tokenizer

        tokenizer = load_tokenizer(self._hf_dir)
        stops = eos_token_ids(self._stop_token_ids, tokenizer)
        return create_backend(self.backend_name, tokenizer, self._vocab_size, stops)

    @property
    def backend(self) -> GrammarBackend:
        """The backend, waiting for its load if it has not finished."""
        return self._loading().result()

    def _loading(self) -> Future[GrammarBackend]:
        if self._backend is None:
            self._backend = self._compile_pool.submit(self._backend_factory)
        return self._backend

    def grammars_for(self, spec: StructuredSpec, n: int) -> list[SequenceGrammar]:
        """Start compiling spec (cached by spec) without waiting for it, nor for the backend's
        load; ValueError for a spec the backend refuses, raised here, before the request is
        queued."""
        grammar = to_grammar(spec, self.backend_name)
        loading = self._loading()
        if loading.done() and loading.exception() is not None:
            raise ValueError(f"structured outputs are unavailable: {loading.exception()}")
        # The one compile thread runs the load first, so the backend is there when this runs.
        future = self._compile_pool.submit(lambda: loading.result().compile_spec(spec, grammar))
        return [SequenceGrammar(loading, future) for _ in range(n)]

    @staticmethod
    def wait_for_any(grammars: list[SequenceGrammar], timeout_s: float) -> None:
        """Until one of grammars is ready or timeout_s passes (without the interpreter lock)."""
        wait([g.compiled for g in grammars], timeout_s, return_when=FIRST_COMPLETED)

    def start_masks(
        self, grammars: list[SequenceGrammar | None], drafts: list[list[int]] | None = None
    ) -> Future[GrammarMask] | None:
        """This step's masks, one bitmask for the logits rows of every sampling sequence in
        turn: grammars[i] is sequence i's (None: unconstrained), drafts[i] the proposals it
        verifies (k_i of them, k_i + 1 rows; None: no proposals, one row each). None when no
        sequence has a grammar. Overlapping: filled and expanded into an additive bias on the
        mask thread while the forward runs. Else: the bitmask, filled right here."""
        if all(g is None for g in grammars):
            return None
        spans = drafts if drafts is not None else [[] for _ in grammars]
        if self.overlap:
            return self._mask_pool.submit(self._bias, grammars, spans)
        done: Future[GrammarMask] = Future()
        done.set_result(self._fill(grammars, spans))
        return done

    def _fill(self, grammars: list[SequenceGrammar | None], drafts: list[list[int]]) -> GrammarMask:
        num_rows = sum(len(d) + 1 for d in drafts)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            self._bitmask = self.backend.allocate_bitmask(max(num_rows, 64))
        rows: list[int] = []
        row = 0
        for grammar, draft_ids in zip(grammars, drafts, strict=True):
            if grammar is not None:
                grammar.fill_rows(self._bitmask, row, draft_ids)
                rows.extend(range(row, row + len(draft_ids) + 1))
            row += len(draft_ids) + 1
        return GrammarMask(tuple(rows), bitmask=self._bitmask[:num_rows])

    def _bias(self, grammars: list[SequenceGrammar | None], drafts: list[list[int]]) -> GrammarMask:
        filled = self._fill(grammars, drafts)
        assert filled.bitmask is not None
        bias = bitmask_to_bias(filled.bitmask, self.backend.vocab_size)
        return GrammarMask(filled.rows, bias=bias)

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
