"""Packs a scheduled batch into one model call over the paged KV cache.

All scheduled tokens of all sequences go into a single `[1, T]` row (decodes first,
then prefill chunks) with their true position ids; `logits_to_keep` limits the LM head
to the one position per sequence that samples this step.

A step that feeds image placeholder positions (vision-language models) is fed as
`inputs_embeds`: the text embeddings of all its tokens, with those positions overwritten
by the sequences' precomputed image features. Every other step feeds `input_ids`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.attention import AttentionMetadata, PrefillSpan
from workers.kv_cache import PagedKVCache
from workers.multimodal import ImageFeatures, ImageInputs, encode_images
from workers.sequence import Sequence


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `seq`, starting at its first uncomputed position.

    `samples` is fixed when scheduled: the chunk reaches the end of the sequence, so
    the step yields a token for it.
    """

    seq: Sequence
    num_tokens: int
    samples: bool

    @classmethod
    def of(cls, seq: Sequence, num_tokens: int) -> "ScheduledChunk":
        return cls(seq, num_tokens, seq.num_computed_tokens + num_tokens == seq.num_tokens)


@dataclass(frozen=True)
class PromptLogitRows:
    """Logits rows (after the S sampling rows) that score prompt tokens of one chunk."""

    seq: Sequence
    first_position: int  # the row for position p predicts prompt token p + 1
    count: int


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S + prompt rows]
    attn_metadata: AttentionMetadata
    prompt_rows: list[PromptLogitRows]
    image_indices: torch.Tensor | None = None  # [I] packed positions fed by image features
    image_embeds: torch.Tensor | None = None  # [I, hidden]


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device

    @torch.inference_mode()
    def forward(
        self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]
    ) -> tuple[torch.Tensor, list[PromptLogitRows]]:
        """Run one step. Returns float32 logits: first one row per sampling chunk (decodes
        first), then the prompt-logprob rows described by the returned list."""
        inputs = self.prepare(decodes, prefills)
        if inputs.image_embeds is None:
            feed = {"input_ids": inputs.input_ids}
        else:
            feed = {"inputs_embeds": self._embeds_with_images(inputs)}
        out = self.model(
            **feed,
            position_ids=inputs.position_ids,
            attn_metadata=inputs.attn_metadata,
            logits_to_keep=inputs.logits_indices,
            use_cache=False,
        )
        return out.logits[0].float(), inputs.prompt_rows

    def encode_images(self, images: ImageInputs) -> ImageFeatures:
        return encode_images(self.model, images, self.device)

    def _embeds_with_images(self, inputs: ModelInputs) -> torch.Tensor:
        index = inputs.image_indices
        ids = inputs.input_ids.clone()
        ids[0, index] = 0  # a placeholder id may lie outside the text embedding table
        embeds = self.model.get_input_embeddings()(ids)
        embeds[0, index] = inputs.image_embeds.to(embeds.dtype)
        return embeds

    def prepare(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> ModelInputs:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        images = _ImageRows()
        for row, chunk in enumerate(decodes):
            seq = chunk.seq
            pos = seq.num_computed_tokens
            images.add(seq, pos, 1, row)
            token_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        pos_parts = [torch.tensor(positions, dtype=torch.long)]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        logits_indices = list(range(len(decodes)))
        prompt_indices: list[int] = []
        prompt_rows: list[PromptLogitRows] = []
        spans: list[PrefillSpan] = []
        offset = len(decodes)
        for chunk in prefills:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            images.add(seq, start, n, offset)
            token_ids.extend(seq.token_ids[start : start + n])
            all_pos = torch.arange(start + n)
            all_slots = self._slots(seq.block_table, all_pos)
            pos_parts.append(all_pos[start:])
            slot_parts.append(all_slots[start:])
            spans.append(self._prefill_span(offset, start, n, all_slots))
            rows = _prompt_logprob_rows(seq, start, n)
            if rows is not None:
                prompt_rows.append(rows)
                prompt_indices.extend(range(offset + rows.first_position - start, offset + rows.first_position - start + rows.count))
            offset += n
            if chunk.samples:
                logits_indices.append(offset - 1)
        decode_blocks, decode_mask = self._decode_context(decodes)
        device = self.device
        metadata = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat(slot_parts).to(device),
            num_decode_tokens=len(decodes),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            prefills=spans,
        )
        return ModelInputs(
            input_ids=torch.tensor(token_ids, dtype=torch.long, device=device).unsqueeze(0),
            position_ids=torch.cat(pos_parts).to(device).unsqueeze(0),
            logits_indices=torch.tensor(logits_indices + prompt_indices, dtype=torch.long, device=device),
            attn_metadata=metadata,
            prompt_rows=prompt_rows,
            **images.tensors(device),
        )

    def _slots(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prefill_span(self, offset: int, start: int, n: int, all_slots: torch.Tensor) -> PrefillSpan:
        if start == 0:
            return PrefillSpan(offset, offset + n, None, None)
        # Earlier context is in the cache (chunked prefill or resume): attend to it too.
        q_pos = torch.arange(start, start + n).unsqueeze(1)
        k_pos = torch.arange(start + n).unsqueeze(0)
        mask = (k_pos <= q_pos).to(self.device)
        return PrefillSpan(offset, offset + n, all_slots.to(self.device), mask)

    def _decode_context(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(block tables [D, W], context mask [D, 1, 1, W * block_size]) of the decode rows."""
        if not decodes:
            return None, None
        # Only the blocks that hold context: a sequence may own more (reserved ahead).
        ctx_lens = [c.seq.num_computed_tokens + 1 for c in decodes]
        bs = self.block_size
        tables = [c.seq.block_table[: (n + bs - 1) // bs] for c, n in zip(decodes, ctx_lens)]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        mask = torch.arange(width * bs).unsqueeze(0) < torch.tensor(ctx_lens).unsqueeze(1)
        return padded.to(self.device), mask.view(len(tables), 1, 1, width * bs).to(self.device)


class _ImageRows:
    """Packed positions of this step that image features feed, and those features."""

    def __init__(self) -> None:
        self.indices: list[torch.Tensor] = []
        self.embeds: list[torch.Tensor] = []

    def add(self, seq: Sequence, start: int, n: int, offset: int) -> None:
        if seq.image_features is None:
            return
        positions, embeds = seq.image_features.rows(start, start + n)
        if positions.numel():
            self.indices.append(positions - start + offset)
            self.embeds.append(embeds)

    def tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        if not self.indices:
            return {}
        return {"image_indices": torch.cat(self.indices).to(device), "image_embeds": torch.cat(self.embeds)}


def _prompt_logprob_rows(seq: Sequence, start: int, n: int) -> PromptLogitRows | None:
    """Positions of this chunk whose logits score a later prompt token, if the request asks."""
    if seq.params.prompt_logprobs is None or seq.num_output_tokens > 0:
        return None  # not asked, or a recompute after preemption (already scored)
    end = min(start + n, seq.num_prompt_tokens - 1)
    return PromptLogitRows(seq, start, end - start) if end > start else None
