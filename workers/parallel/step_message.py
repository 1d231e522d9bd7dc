"""What the driver sends the other shards each step: the packed model inputs, the KV block
copies of that step (copy-on-write of shared prefix blocks), so that every shard writes
and reads the same slots of its own part of the KV pool, and the step's LoRA rows with the
adapters written into slots since the last step (their whole weights, once a load). Only
tensors and a few integers cross; each shard rebuilds the attention metadata around its
own pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.lora.layers import LoraSegments
from workers.lora.peft_files import LoraAdapter
from workers.model.attention import AttentionMetadata, PrefillSpan
from workers.model.kv_cache import PagedKVCache


@dataclass
class StepMessage:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_to_keep: torch.Tensor  # [K]
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_blocks: torch.Tensor | None
    decode_mask: torch.Tensor | None
    decode_context_lens: torch.Tensor | None
    prefills: list[tuple[int, int, torch.Tensor | None, torch.Tensor | None]]
    block_copies: list[tuple[int, int]]
    lora_step: LoraSegments | None = None  # the step's rows by adapter slot
    lora_loads: list[tuple[int, LoraAdapter]] = field(default_factory=list)  # whole adapters written into slots
    cpu_decode: bool = False  # decode rows by the C kernel (then decode_mask is None)

    @classmethod
    def of(cls, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
           logits_to_keep: torch.Tensor, block_copies: list[tuple[int, int]], lora_step: LoraSegments | None = None,
           lora_loads: list[tuple[int, LoraAdapter]] | None = None) -> "StepMessage":
        return cls(input_ids, position_ids, logits_to_keep, meta.slot_mapping, meta.num_decode_tokens,
                   meta.decode_blocks, meta.decode_mask, meta.decode_context_lens,
                   [(s.start, s.end, s.context_slots, s.mask) for s in meta.prefills], list(block_copies),
                   lora_step, lora_loads or [], meta.cpu_decode)

    def metadata(self, kv_cache: PagedKVCache) -> AttentionMetadata:
        return AttentionMetadata(
            kv_cache=kv_cache,
            slot_mapping=self.slot_mapping,
            num_decode_tokens=self.num_decode_tokens,
            decode_blocks=self.decode_blocks,
            decode_mask=self.decode_mask,
            prefills=[PrefillSpan(*span) for span in self.prefills],
            decode_context_lens=self.decode_context_lens,
            cpu_decode=self.cpu_decode,
        )
