"""What the engine, its scheduler, the model runner and CUDA graphs ask of the engine's LoRA
state (`AdapterSlots`; workers/lora/manager.py has the real one), and `NoAdapters`, the
null object an engine without LoRA holds, so none of them branches on LoRA being on."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Protocol

import torch

from workers.contract.lora import LoraAdapterError
from workers.core.batch import ScheduledChunk
from workers.core.sequence import Adapter, Sequence


class AdapterSlots(Protocol):
    @property
    def num_slots(self) -> int:
        """Adapter slots on the device (0: no LoRA layers); a CUDA graph's slot input uses
        this value for a row without an adapter."""

    # --- adapters (the engine's side) ---
    def check(self, adapter: Adapter) -> None: ...

    def add(self, adapter: Adapter) -> None: ...

    def remove(self, key: str) -> bool: ...

    def get(self, key: str) -> Adapter: ...

    # --- slots (the scheduler's side): a sequence holds its adapter's slot while it runs ---
    def admit(self, seq: Sequence) -> bool: ...

    def share(self, parent: Sequence, child: Sequence) -> None: ...

    def release(self, seq: Sequence) -> None: ...

    # --- steps (the model runner's and CUDA graphs' side) ---
    def decode_order(self, decodes: list[ScheduledChunk]) -> list[int] | None: ...

    def step(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> AbstractContextManager: ...

    def row_slots(self, decodes: list[ScheduledChunk]) -> list[int]: ...

    def graph_step(self, slot_row: torch.Tensor, dtype: torch.dtype) -> AbstractContextManager: ...


class NoAdapters:
    """An engine that serves no adapters: requests naming one are refused, steps run plain."""

    num_slots = 0

    def check(self, adapter: Adapter) -> None:
        raise LoraAdapterError(f"LoRA adapter {adapter.name!r}: this model serves no LoRA adapters")

    def add(self, adapter: Adapter) -> None:
        self.check(adapter)  # never registers: nothing here could run it

    def remove(self, key: str) -> bool:
        return False

    def get(self, key: str) -> Adapter:
        raise LoraAdapterError(f"LoRA adapter {key!r}: this model serves no LoRA adapters")

    def admit(self, seq: Sequence) -> bool:
        return True

    def share(self, parent: Sequence, child: Sequence) -> None:
        return None

    def release(self, seq: Sequence) -> None:
        return None

    def decode_order(self, decodes: list[ScheduledChunk]) -> list[int] | None:
        return None

    def step(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> AbstractContextManager:
        return nullcontext()

    def row_slots(self, decodes: list[ScheduledChunk]) -> list[int]:
        return [self.num_slots] * len(decodes)

    def graph_step(self, slot_row: torch.Tensor, dtype: torch.dtype) -> AbstractContextManager:
        return nullcontext()
