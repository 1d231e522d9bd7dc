"""A worker replica's LoRA adapters: which it holds, loading one when a request needs it,
and checking one for the ingress's load route.

Inside Serve, holding is Serve's model multiplexing: the ingress calls with
`multiplexed_model_id` = the adapter's key, Serve routes the call to a replica that holds
it when one does, and each replica keeps at most `lora.max_loras` adapters, dropping the
least recently used (its `__del__` unregisters it from the engine; requests already
queued or running keep their weights). Outside Serve (tests, benchmarks) the same loader
runs without the routing or the limit's eviction.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from ray import serve

from workers.contract.chunks import ErrorInfo
from workers.contract.lora import LoraAdapterError, LoraRequest, adapter_path_inside
from workers.contract.model_config import LoraConfig
from workers.lora.peft_files import LoraAdapter, read_peft_adapter

logger = logging.getLogger(__name__)


class AdapterEngine(Protocol):
    """What the replica's engine does with adapters (workers/serving/async_engine.py's AsyncEngine)."""

    def check_lora(self, adapter: LoraAdapter) -> None: ...

    def add_lora(self, adapter: LoraAdapter) -> None: ...

    def remove_lora(self, key: str) -> None: ...


class _Held:
    """One adapter a replica holds; Serve calls `__del__` when it drops it (least recently used)."""

    def __init__(self, engine: AdapterEngine, key: str) -> None:
        self.engine, self.key, self._held = engine, key, True

    def __del__(self) -> None:
        if self._held:  # Serve calls it once on eviction, the garbage collector once more
            self._held = False
            self.engine.remove_lora(self.key)


class WorkerAdapters:
    def __init__(self, engine: AdapterEngine, config: LoraConfig | None, multiplexed: bool) -> None:
        """`multiplexed`: inside a Serve replica (Serve routes and evicts)."""
        self.engine = engine
        self.config = config
        # key -> (its request, callers waiting on it): the loader takes only a key.
        self._pending: dict[str, tuple[LoraRequest, int]] = {}
        self._held: dict[str, _Held] = {}  # outside Serve: everything loaded stays
        self._load: Callable[[str], Awaitable[_Held]] = self._load_key
        if multiplexed and config is not None:
            async def load(key: str) -> _Held:  # a plain function: Serve keeps its LRU state on it
                return await self._read_and_add(key)

            self._load = serve.multiplexed(max_num_models_per_replica=config.max_loras)(load)

    def check_configured(self) -> None:
        """Read and check every adapter the config names (raises LoraAdapterError): a bad one
        fails the replica's start, not its first request."""
        for name, path in (self.config.adapters if self.config else {}).items():
            self.engine.check_lora(read_peft_adapter(LoraRequest.of(name, path)))

    async def check(self, name: str, path: str) -> ErrorInfo | None:
        """The ingress's load route: None when `path` (inside lora.adapter_dir) holds an
        adapter this model can serve, else the 400 to answer."""
        try:
            resolved = adapter_path_inside(self.config.adapter_dir if self.config else None, path)
            adapter = await asyncio.to_thread(read_peft_adapter, LoraRequest.of(name, str(resolved)))
            self.engine.check_lora(adapter)
        except LoraAdapterError as exc:
            return exc.info("lora_path")
        return None

    async def ensure(self, request: LoraRequest) -> ErrorInfo | None:
        """Make sure this replica holds `request`'s adapter (loading it if not); the error
        to answer the request with when it cannot."""
        try:
            self._allowed(request)
        except LoraAdapterError as exc:
            return exc.info()
        key = request.key
        self._pending[key] = (request, self._pending.get(key, (request, 0))[1] + 1)
        try:
            await self._load(key)
        except LoraAdapterError as exc:
            return exc.info()
        finally:
            waiting = self._pending[key][1] - 1
            if waiting:
                self._pending[key] = (request, waiting)
            else:
                del self._pending[key]
        return None

    def _allowed(self, request: LoraRequest) -> None:
        """Only adapters the config names, or paths inside its adapter_dir, are read."""
        config = self.config
        if config is None:
            raise LoraAdapterError(f"LoRA adapter {request.name!r}: this model serves no LoRA adapters")
        if config.adapters.get(request.name) != request.path:
            adapter_path_inside(config.adapter_dir, request.path)

    async def _load_key(self, key: str) -> _Held:
        held = self._held.get(key)
        if held is None:
            held = self._held[key] = await self._read_and_add(key)
        return held

    async def _read_and_add(self, key: str) -> _Held:
        request, _ = self._pending[key]
        adapter: LoraAdapter = await asyncio.to_thread(read_peft_adapter, request)
        self.engine.add_lora(adapter)
        logger.info("LoRA adapter %s loaded from %s (rank %d, %d modules)", request.name, request.path,
                    adapter.rank, len(adapter.modules))
        return _Held(self.engine, key)
