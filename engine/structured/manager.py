"""The engine core's side of structured outputs: each constrained sequence's matcher, grammar
compilation off the step loop, and the token masks of a step computed while its forward runs.

Compiling starts when a request arrives (on the compile thread; the prompt's prefill can run
meanwhile); the first mask that needs the grammar waits for it. A step's masks are filled on the
mask thread while the model's forward pass runs on the step thread (torch and xgrammar both release
the interpreter lock), so a constrained step costs little more than a free one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kvpilot.engine.structured.backend import (
    GrammarBackend,
    GrammarMatcher,
    XGrammarBackend,
    to_grammar,
)
from kvpilot.engine.structured.spec import StructuredSpec

log = logging.getLogger("kvpilot")


class SequenceGrammar:
    """One sequence's grammar state: its compiled grammar (maybe still compiling) and matcher.
    A request with n > 1 gives each sequence its own."""

    def __init__(self, backend: GrammarBackend, compiled: Future[Any]) -> None:
        self._backend = backend
        self._compiled = compiled
        self._matcher: GrammarMatcher | None = None
        self.is_broken = False  # a token the grammar refused (never expected: masks forbid it)

    @property
    def matcher(self) -> GrammarMatcher:
        if self._matcher is None:
            self._matcher = self._backend.matcher(self._compiled.result())
        return self._matcher

    def accept(self, token_id: int) -> None:
        if not self.matcher.accept(token_id):
            self.is_broken = True
            log.error("the grammar refused token %d, which its mask allowed", token_id)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated


class StructuredOutputs:
    """Created once per core; the backend (the tokenizer's vocabulary) loads on first use."""

    def __init__(
        self,
        hf_dir: Path,
        vocab_size: int,
        stop_token_ids: tuple[int, ...],
        *,
        overlap: bool = True,
        backend_factory: Callable[[], GrammarBackend] | None = None,
    ) -> None:
        self._hf_dir = hf_dir
        self._vocab_size = vocab_size
        self._stop_token_ids = stop_token_ids
        self._backend_factory = backend_factory or self._xgrammar
        self._backend: GrammarBackend | None = None
        self.overlap = overlap
        self._compile_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-grammar-compile")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="kvpilot-grammar-mask")
        self._bitmask: torch.Tensor | None = None

    def _xgrammar(self) -> GrammarBackend:
        from kvpilot.engine.model.loader import eos_token_ids, load_tokenizer

        tokenizer = load_tokenizer(self._hf_dir)
        stops = eos_token_ids(self._stop_token_ids, tokenizer)
        return XGrammarBackend(tokenizer, self._vocab_size, stops)

    @property
    def backend(self) -> GrammarBackend:
        if self._backend is None:
            self._backend = self._backend_factory()
        return self._backend

    def grammars_for(self, spec: StructuredSpec, n: int) -> list[SequenceGrammar]:
        """Start compiling spec (cached by spec); ValueError for a spec the backend refuses, raised
        here, before the request is queued."""
        grammar = to_grammar(spec)
        backend = self.backend
        compile_spec = getattr(backend, "compile_spec", None)
        if compile_spec is not None:
            future = self._compile_pool.submit(compile_spec, spec, grammar)
        else:
            future = self._compile_pool.submit(backend.compile, grammar)
        return [SequenceGrammar(backend, future) for _ in range(n)]

    def start_masks(self, grammars: list[SequenceGrammar | None]) -> Future[torch.Tensor] | None:
        """Fill the masks of the rows that have a grammar (row i of the bitmask for grammars[i]);
        None when no row has one. On the mask thread when overlapping, else right here."""
        if all(g is None for g in grammars):
            return None
        if self.overlap:
            return self._mask_pool.submit(self._fill, grammars)
        done: Future[torch.Tensor] = Future()
        done.set_result(self._fill(grammars))
        return done

    def _fill(self, grammars: list[SequenceGrammar | None]) -> torch.Tensor:
        rows = len(grammars)
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            self._bitmask = self.backend.allocate_bitmask(max(rows, 64))
        bitmask = self._bitmask[:rows]
        for i, grammar in enumerate(grammars):
            if grammar is not None:
                grammar.matcher.fill_mask(self._bitmask, i)
        return bitmask

    def shutdown(self) -> None:
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
