"""Pipeline parallelism: a model's layers in consecutive stages, one shard each.

The driver (stage 0) sends every shard the step (step_message.py), embeds the tokens, runs
its layers and sends the hidden states on; each later stage receives them, runs its
layers and sends them on; the last stage applies the final norm and output head and sends
the logits back to the driver, which samples. Each step goes through in micro-batches
(micro_batches.py), as many as there are stages, so that while a stage runs one
micro-batch the one before it runs the next; sends do not wait for the receiver. A stage
may itself be split by tensors (shard_group.py's ShardLayout): each of its tensor shards
passes the (whole, summed) hidden states to the same tensor rank of the next stage, and
the last stage gathers its logits on its first tensor shard, which sends them. One step
is in the pipeline at a time (the next step's tokens depend on this one's logits): a step
of one sequence cannot be cut, and its stages run one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.lora.layers import LoraContext
from workers.model.attention import AttentionMetadata
from workers.model.direct_forward import DirectForward
from workers.parallel.micro_batches import MicroBatch, micro_batches
from workers.parallel.shard_group import ShardGroup

_LAYER_PREFIX = "model.layers."


@dataclass(frozen=True)
class StageLayers:
    """Stage `stage` of `stages` runs layers [start, end)."""

    stage: int
    stages: int
    start: int
    end: int

    @classmethod
    def of(cls, stage: int, stages: int, num_layers: int) -> "StageLayers":
        """Layers split evenly; the first stages take one more where they do not divide."""
        base, extra = divmod(num_layers, stages)
        start = stage * base + min(stage, extra)
        return cls(stage, stages, start, start + base + (1 if stage < extra else 0))

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def layers(self) -> range:
        return range(self.start, self.end)

    def holds(self, name: str, tied: bool) -> bool:
        """Whether this stage keeps the checkpoint parameter `name` (`tied`: the output head
        is the embedding, which the last stage then keeps too)."""
        if name.startswith(_LAYER_PREFIX):
            return int(name[len(_LAYER_PREFIX):].split(".", 1)[0]) in self.layers
        if "embed_tokens" in name:
            return self.first or (tied and self.last)
        return self.last  # the final norm and the output head


class PipelineStageForward:
    """A shard's part of each step, micro-batch by micro-batch: hidden states in (or, on
    the first stage, the embedded tokens), its layers, hidden states (or, on the last
    stage, the logits for the driver) out. On the driver (the first stage's first shard)
    it then returns the step's logits [1, K, vocab] from the last stage; elsewhere None."""

    def __init__(self, forward: DirectForward, group: ShardGroup, stage: StageLayers, dtype: torch.dtype,
                 lora_context: LoraContext | None = None) -> None:
        """`lora_context`: this shard's LoRA layers' context, when it has them."""
        self.forward = forward
        self.group = group
        self.stage = stage
        self.dtype = dtype
        self.vocab_size = forward.vocab_size
        self.lora_context = lora_context

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
                 logits_to_keep: torch.Tensor) -> torch.Tensor | None:
        parts = micro_batches(meta, input_ids.shape[1], logits_to_keep, self._parts())
        for part in parts:
            if self.stage.first:
                hidden = self.forward.embed_ids(input_ids[:, part.tokens])
            else:
                hidden = self.group.receive_tensor((part.end - part.start, self.forward.hidden_size), self.dtype,
                                                   self.stage.stage - 1)
            hidden = self.forward.run_layers(hidden, position_ids[:, part.tokens], part.meta)
            if not self.stage.last:
                self.group.send_tensor(hidden, self.stage.stage + 1)
            elif part.keep.numel():
                logits = self.forward.head(hidden, part.keep)  # None on a tensor shard but the first
                if logits is not None:
                    self.group.send_tensor(logits[0], 0)  # [K, vocab], to the driver
        self.group.wait_sends()
        return self._last_stage_logits(parts, logits_to_keep) if self.group.is_driver else None

    def _parts(self) -> int:
        """As many micro-batches as stages; one while the step has LoRA rows (their runs
        index the whole step's rows: cutting them is not built)."""
        lora_step = self.lora_context.step if self.lora_context is not None else None
        return 1 if lora_step is not None else self.stage.stages

    def _last_stage_logits(self, parts: list[MicroBatch], logits_to_keep: torch.Tensor) -> torch.Tensor:
        logits = torch.empty((logits_to_keep.shape[0], self.vocab_size), dtype=self.dtype, device=self.group.device)
        for part in parts:
            if part.keep.numel():
                logits[part.kept_at] = self.group.receive_tensor((part.keep.shape[0], self.vocab_size), self.dtype,
                                                                 self.stage.stages - 1)
        return logits.unsqueeze(0)
