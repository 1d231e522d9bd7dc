"""A non-driver shard of a split replica (a tensor shard, or a later pipeline stage): it
builds its part of the KV pool as the driver sizes it, then runs each step the driver
sends, until told to stop."""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from workers.core.limits import LoraLimits
from workers.lora.layers import LoraContext
from workers.lora.manager import LoraManager
from workers.model.direct_forward import DirectForward
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.parallel.lora_split import AdapterCut
from workers.parallel.pipeline import PipelineStageForward, StageLayers
from workers.parallel.shard_group import ShardGroup
from workers.parallel.step_message import StepMessage
from workers.parallel.transformers_split import (
    TransformersShardForward,
    tensor_shard_forward,
)


@dataclass(frozen=True)
class KVPlan:
    """The driver's KV pool, which every shard mirrors with its own KV heads, and its LoRA
    slots (None: no LoRA layers), which every shard mirrors with its part of the layers."""

    num_blocks: int
    block_size: int
    lora: LoraLimits | None = None


def shard_kv_shape(model: nn.Module, world: int, stage: StageLayers | None = None) -> KVCacheShape:
    """One shard's KV shape: its part of the KV heads (a tensor split over `world`) of its
    pipeline stage's layers (all, when unsplit by layers)."""
    shape = KVCacheShape.from_model_config(model.config, model.dtype)
    shape = dataclasses.replace(shape, num_kv_heads=shape.num_kv_heads // world)
    if stage is not None:
        shape = dataclasses.replace(shape, num_layers=stage.end - stage.start)
    return shape


def shard_lora(model: nn.Module, limits: LoraLimits, group: ShardGroup,
               stage: StageLayers | None = None) -> LoraManager:
    """LoRA layers over a shard's part of the model (its pipeline stage's layers, when
    split by layers), which write their part of each adapter."""
    return LoraManager(model, limits, AdapterCut(model.config, group.position, stage))


def split_forward(model: nn.Module, group: ShardGroup, stage: StageLayers | None,
                  lora_context: LoraContext | None) -> DirectForward | TransformersShardForward | PipelineStageForward:
    """This shard's forward: its tensor part, or its part of its pipeline stage (over the
    stage's tensor shards when it has several). Build it after any LoRA layers wrap the
    products."""
    if stage is None:
        return tensor_shard_forward(model, group)
    layers = DirectForward(model, group if group.world > 1 else None, layers=stage.layers)
    return PipelineStageForward(layers, group, stage, model.dtype, lora_context)


class ShardLoop:
    def __init__(self, model: nn.Module, group: ShardGroup, device: torch.device,
                 stage: StageLayers | None = None) -> None:
        """`model`: this shard's part (sliced_load.py); `stage`: its pipeline stage, when the
        model is split by layers. Waits for the driver's KV plan."""
        plan = group.receive()
        self.group = group
        shape = shard_kv_shape(model, group.world, stage)
        self.kv_cache = PagedKVCache(shape, plan.num_blocks, plan.block_size, device)
        # Before the forward: it calls the LoRA layers where they wrap the projections.
        self.lora = shard_lora(model, plan.lora, group, stage) if plan.lora is not None else None
        self.forward = split_forward(model, group, stage, self.lora.context if self.lora is not None else None)
        self.steps = 0

    @torch.inference_mode()
    def run(self) -> None:
        """Run the driver's steps until it sends None."""
        while True:
            message: StepMessage | None = self.group.receive()
            if message is None:
                return
            self.kv_cache.copy_blocks(message.block_copies)
            step = nullcontext()
            if self.lora is not None:
                for slot, adapter in message.lora_loads:
                    self.lora.load_slot(slot, adapter)
                step = self.lora.context.active(message.lora_step)
            with step:
                self.forward(message.input_ids, message.position_ids, message.metadata(self.kv_cache),
                             message.logits_to_keep)
            self.steps += 1
