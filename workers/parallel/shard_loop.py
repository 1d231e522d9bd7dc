"""A non-driver shard of a split replica (a tensor shard, or a later pipeline stage): it
builds its part of the KV pool as the driver sizes it, then runs each step the driver
sends, until told to stop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.direct_forward import DirectForward
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.parallel.pipeline import PipelineStageForward, StageLayers
from workers.parallel.step_message import StepMessage
from workers.parallel.tensor_group import TensorGroup


@dataclass(frozen=True)
class KVPlan:
    """The driver's KV pool, which every shard mirrors with its own KV heads."""

    num_blocks: int
    block_size: int


def shard_kv_shape(model: nn.Module, world: int, stage: StageLayers | None = None) -> KVCacheShape:
    """One shard's KV shape: its part of the KV heads (a tensor split over `world`) of its
    pipeline stage's layers (all, when unsplit by layers)."""
    shape = KVCacheShape.from_model_config(model.config, model.dtype)
    shape = dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads // world)
    if stage is not None:
        shape = dataclasses.replace(shape, num_layers=stage.end - stage.start)
    return shape


def stage_forward(model: nn.Module, group: TensorGroup, stage: StageLayers) -> DirectForward:
    """A pipeline stage's layers, over its tensor shards when it has several."""
    return DirectForward(model, group if group.world > 1 else None, layers=stage.layers)


class ShardLoop:
    def __init__(self, model: nn.Module, group: TensorGroup, device: torch.device,
                 stage: StageLayers | None = None) -> None:
        """`model`: this shard's part (sliced_load.py); `stage`: its pipeline stage, when the
        model is split by layers. Waits for the driver's KV plan."""
        plan = group.receive()
        self.group = group
        shape = shard_kv_shape(model, group.world, stage)
        self.kv_cache = PagedKVCache(shape, plan.num_blocks, plan.block_size, device)
        if stage is None:
            self.forward = DirectForward(model, group)
        else:
            self.forward = PipelineStageForward(stage_forward(model, group, stage), group, stage, model.dtype)
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
