"""A non-driver shard of a tensor-parallel replica: it builds its part of the KV pool as
the driver sizes it, then runs each step the driver sends, until told to stop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.direct_forward import DirectForward
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.parallel.step_message import StepMessage
from workers.parallel.tensor_group import TensorGroup


@dataclass(frozen=True)
class KVPlan:
    """The driver's KV pool, which every shard mirrors with its own KV heads."""

    num_blocks: int
    block_size: int


def shard_kv_shape(model: nn.Module, world: int) -> KVCacheShape:
    """One shard's KV shape: its part of the KV heads."""
    shape = KVCacheShape.from_model_config(model.config, model.dtype)
    return dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads // world)


class ShardLoop:
    def __init__(self, model: nn.Module, group: TensorGroup, device: torch.device) -> None:
        """`model`: this shard's part (tensor_split.py). Waits for the driver's KV plan."""
        plan = group.receive()
        self.group = group
        self.kv_cache = PagedKVCache(shard_kv_shape(model, group.world), plan.num_blocks, plan.block_size, device)
        self.forward = DirectForward(model, group)
        self.steps = 0

    @torch.inference_mode()
    def run(self) -> None:
        """Run the driver's steps until it sends None."""
        while True:
            message: StepMessage | None = self.group.receive()
            if message is None:
                return
            self.kv_cache.copy_blocks(message.block_copies)
            self.forward(message.input_ids, message.position_ids, message.metadata(self.kv_cache),
                         message.logits_to_keep)
            self.steps += 1
