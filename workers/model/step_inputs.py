"""A step's model inputs, built from its scheduled chunks: the packed decode rows and their
block tables, the rows image features feed, the rows that score prompt tokens. The model
runner and CUDA graphs both build from these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.core.batch import PoolRows, PromptLogitRows, ScheduledChunk
from workers.core.sequence import Sequence
from workers.model.attention import AttentionMetadata


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [1, T]
    position_ids: torch.Tensor  # [1, T]
    logits_indices: torch.Tensor  # [S + prompt rows]
    attn_metadata: AttentionMetadata
    prompt_rows: list[PromptLogitRows]
    pool_rows: list[PoolRows] = field(default_factory=list)  # embedding sequences' rows
    pool_indices: torch.Tensor | None = None  # [P] their packed positions, in pool_rows' order
    image_indices: torch.Tensor | None = None  # [I] packed positions fed by image features
    image_embeds: torch.Tensor | None = None  # [I, hidden]


def decode_rows(decodes: list[ScheduledChunk], block_size: int,
                with_tokens: bool = True) -> tuple[list[int], list[int], list[int]]:
    """(input token ids, positions, KV slots) of the decode rows: each feeds the token at
    its first uncomputed position. `with_tokens` False: the ids are 0, for the caller to
    fill from the device (async scheduling: they are not on the host yet)."""
    ids, positions, slots = [], [], []
    for chunk in decodes:
        seq = chunk.seq
        pos = seq.num_computed_tokens
        ids.append(seq.token_ids[pos] if with_tokens else 0)
        positions.append(pos)
        slots.append(seq.block_table[pos // block_size] * block_size + pos % block_size)
    return ids, positions, slots


def decode_block_tables(decodes: list[ScheduledChunk], ctx_lens: list[int], block_size: int,
                        pad_block: int = 0, rows: int | None = None) -> torch.Tensor:
    """[rows, W] long: each decode's blocks that hold context (a sequence may own more,
    reserved ahead), padded with `pad_block`; rows past the decodes are all padding."""
    tables = [c.seq.block_table[: (n + block_size - 1) // block_size] for c, n in zip(decodes, ctx_lens)]
    width = max(len(t) for t in tables)
    padded = [t + [pad_block] * (width - len(t)) for t in tables]
    padded += [[pad_block] * width] * ((rows or len(decodes)) - len(decodes))
    return torch.tensor(padded, dtype=torch.long)


def feeds_images(decodes: list[ScheduledChunk]) -> bool:
    """A decode row at an image placeholder (a prompt's last token) needs the eager path."""
    for chunk in decodes:
        features, pos = chunk.seq.image_features, chunk.seq.num_computed_tokens
        if features is not None and features.rows(pos, pos + 1)[0].numel():
            return True
    return False


class ImageRows:
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


def prompt_logprob_rows(seq: Sequence, start: int, n: int) -> PromptLogitRows | None:
    """Positions of this chunk whose logits score a later prompt token, if the request asks."""
    if seq.params.prompt_logprobs is None or seq.num_output_tokens > 0:
        return None  # not asked, or a recompute after preemption (already scored)
    end = min(start + n, seq.num_prompt_tokens - 1)
    return PromptLogitRows(seq, start, end - start) if end > start else None


def pool_rows(chunk: ScheduledChunk) -> PoolRows | None:
    """The rows of a chunk whose hidden states pool into an embedding: every row (mean), or
    the prompt's last (last token), else None (not an embedding request)."""
    pooling = chunk.seq.params.pooling
    if pooling is None:
        return None
    restart = chunk.seq.num_computed_tokens == 0
    if pooling.kind == "mean":
        return PoolRows(chunk.seq, chunk.num_tokens, chunk.samples, restart)
    return PoolRows(chunk.seq, 1, True, restart) if chunk.samples else None
