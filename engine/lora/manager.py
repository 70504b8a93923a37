"""The engine core's book of adapters: which exist (name -> path), which are read into host memory
(an LRU of max_cpu_loras), and which sit in the device's max_loras slots.

Reading an adapter's files happens on a thread of its own, so a step never waits for a disk or a
download: a request whose adapter is not read yet waits in the queue, keeping its place, and the
steps of everyone else go on. Filling a slot is a copy between memories, done by the model runner
at the start of the step that first uses it (`take_fills`). A slot is never refilled while a running
sequence uses its adapter.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from kvpilot.engine.config import LoRAConfig
from kvpilot.engine.lora.adapter import AdapterError, LoRAAdapter

log = logging.getLogger("kvpilot")

ReadAdapter = Callable[[str, str], LoRAAdapter]  # (name, path) -> the adapter, or AdapterError


class LoRAManager:
    def __init__(self, config: LoRAConfig, read: ReadAdapter) -> None:
        self.config = config
        self._read = read
        self.paths: dict[str, str] = {}  # every adapter requests may name
        self._host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self._reading: dict[str, Future[LoRAAdapter]] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvpilot-lora")
        self.slots: list[str | None] = [None] * config.max_loras
        self._slot_use: list[int] = [0] * config.max_loras  # last use, for LRU among idle slots
        self._uses = 0
        self._fills: list[tuple[int, LoRAAdapter]] = []
        # Adapters whose files could not be read again after they left host memory (name ->
        # why): the core refuses the requests waiting on them instead of letting them wait.
        self.unreadable: dict[str, str] = {}

    # ---- registration --------------------------------------------------------------------------
    def read(self, name: str, path: str, *, replace: bool = False) -> Future[LoRAAdapter]:
        """Starts reading the adapter at `path` on the reading thread; the caller polls the
        future and registers the result with `add` (on its own thread). The future raises
        AdapterError for files the engine cannot use; an AdapterError here when `name` is taken
        and not to be replaced."""
        if name in self.paths and not replace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        return self._executor.submit(self._read, name, path)

    def add(self, adapter: LoRAAdapter) -> None:
        """Registers a read adapter (replacing one of the same name, which leaves its slot)."""
        self._forget(adapter.name)
        self.paths[adapter.name] = adapter.path
        self._keep(adapter)

    def unregister(self, name: str) -> None:
        """Forgets the adapter (the caller has checked that no request uses it)."""
        if name not in self.paths:
            raise KeyError(name)
        del self.paths[name]
        self._forget(name)

    def _forget(self, name: str) -> None:
        self.unreadable.pop(name, None)
        self._host.pop(name, None)
        self._reading.pop(name, None)
        for slot, held in enumerate(self.slots):
            if held == name:
                self.slots[slot] = None
        self._fills = [(s, a) for s, a in self._fills if a.name != name]

    # ---- host memory ---------------------------------------------------------------------------
    def is_ready(self, name: str) -> bool:
        """Whether the adapter is in host memory (if not, it starts being read again: it was
        evicted from the LRU)."""
        if name in self._host:
            return True
        future = self._reading.get(name)
        if future is None:
            self._reading[name] = self._executor.submit(self._read, name, self.paths[name])
            return False
        if not future.done():
            return False
        del self._reading[name]
        if future.exception() is not None:  # its files changed since it was registered
            log.warning("adapter %s could not be read again: %s", name, future.exception())
            self.unreadable[name] = str(future.exception())
            return False
        self._keep(future.result())
        return True

    def _keep(self, adapter: LoRAAdapter) -> None:
        self._host[adapter.name] = adapter
        self._host.move_to_end(adapter.name)
        while len(self._host) > self.config.resolved_max_cpu_loras:
            self._host.popitem(last=False)

    def adapter(self, name: str) -> LoRAAdapter:
        return self._host[name]

    # ---- device slots --------------------------------------------------------------------------
    def slot_for(self, name: str, busy: set[str]) -> int | None:
        """The slot holding `name`, taking one for it if needed (a free slot, else the least
        recently used slot of an adapter not in `busy`); None when it must wait: not read yet,
        or every slot busy."""
        self._uses += 1
        if name in self.slots:
            slot = self.slots.index(name)
            self._slot_use[slot] = self._uses
            return slot
        if not self.is_ready(name):
            return None
        idle = [s for s, held in enumerate(self.slots) if held is None or held not in busy]
        if not idle:
            return None
        slot = min(idle, key=lambda s: (self.slots[s] is not None, self._slot_use[s]))
        adapter = self._host[name]
        self._host.move_to_end(name)
        self.slots[slot] = name
        self._slot_use[slot] = self._uses
        self._fills.append((slot, adapter))
        return slot

    def take_fills(self) -> list[tuple[int, LoRAAdapter]]:
        """The slots to fill before the next step runs (each once)."""
        fills, self._fills = self._fills, []
        return fills

    @property
    def resident(self) -> list[str]:
        return [name for name in self.slots if name is not None]

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
