"""The driver's side of a split replica: each step goes to the other shards (the packed
inputs, the KV block copies and LoRA slot loads since the last step, the step's LoRA
rows), then the driver runs its own part of the forward (its tensor shard, or its part of
the first pipeline stage) and gets the whole logits back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.lora.layers import LoraContext
from workers.lora.peft_files import LoraAdapter
from workers.model.attention import AttentionMetadata
from workers.model.direct_forward import DirectForward
from workers.parallel.pipeline import PipelineStageForward
from workers.parallel.shard_group import ShardGroup
from workers.parallel.step_message import StepMessage
from workers.parallel.transformers_split import TransformersShardForward


class ShardGroupLost(BaseException):
    """A step of a split model failed: a shard died, or the shards no longer agree on where
    they are. No later step can run, so this is not one request's failure: it escapes the
    engine's per-request containment (a BaseException) and stops the engine."""


class DriverForward:
    """Stands where the runner's DirectForward stands, on shard 0, around this shard's
    forward (which returns the whole logits on the driver)."""

    def __init__(self, forward: DirectForward | TransformersShardForward | PipelineStageForward,
                 group: ShardGroup) -> None:
        self.forward = forward
        self.group = group
        self.vocab_size = forward.vocab_size
        # Called before ShardGroupLost is raised: the worker replica ends its process there,
        # so that its requests' streams break and resume on another replica.
        self.on_lost: Callable[[BaseException], None] | None = None
        self._copies: list[tuple[int, int]] = []
        self._lora_loads: list[tuple[int, LoraAdapter]] = []
        self.lora_context: LoraContext | None = None  # the driver's LoRA layers' context, when it has them

    def record_copies(self, pairs: list[tuple[int, int]]) -> None:
        """KV blocks the driver copied in its pool: every shard copies them in its own before the next step."""
        self._copies.extend(pairs)

    def record_lora_load(self, slot: int, adapter: LoraAdapter) -> None:
        """An adapter the driver wrote into `slot`: every shard writes its part before the next step."""
        self._lora_loads.append((slot, adapter))

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
                 logits_to_keep: torch.Tensor) -> torch.Tensor:
        copies, self._copies = self._copies, []
        loads, self._lora_loads = self._lora_loads, []
        lora_step = self.lora_context.step if self.lora_context is not None else None
        try:
            self.group.send(StepMessage.of(input_ids, position_ids, meta, logits_to_keep, copies, lora_step, loads))
            return self.forward(input_ids, position_ids, meta, logits_to_keep)
        except Exception as exc:
            if self.on_lost is not None:
                self.on_lost(exc)
            raise ShardGroupLost(f"a step of the split model failed: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        """Tell the shards to leave their loops (the replica is stopping)."""
        self.group.send(None)
