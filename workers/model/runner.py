"""Packs a scheduled batch into one model call over the paged KV cache.

All scheduled tokens of all sequences go into a single `[1, T]` row (decodes first,
then prefill chunks) with their true position ids; `logits_to_keep` limits the LM head
to the one position per sequence that samples this step.

With LoRA adapters, the decode rows are packed sorted by adapter slot (their logits rows
are put back in the caller's order), so each adapter's rows form one run
(workers/lora/layers.py) and every prefill chunk is a run of its own sequence.

A step that feeds image placeholder positions (vision-language models) is fed as
`inputs_embeds`: the text embeddings of all its tokens, with those positions overwritten
by the sequences' precomputed image features. Every other step feeds `input_ids`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from workers.core.adapter_slots import AdapterSlots, NoAdapters
from workers.core.batch import PoolRows, PromptLogitRows, ScheduledChunk
from workers.core.images import ImageFeatures, ImageInputs
from workers.model.attention import KERNEL_SPAN, AttentionMetadata, PrefillSpan
from workers.model.kv_cache import PagedKVCache
from workers.model.multimodal import encode_images
from workers.model.step_inputs import (
    ImageRows,
    ModelInputs,
    decode_block_tables,
    decode_rows,
    feeds_images,
    pool_rows,
    prompt_logprob_rows,
)

if TYPE_CHECKING:
    from workers.model.cuda_graphs import DecodeGraphs
    from workers.model.direct_forward import DirectForward


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device,
                 triton_decode: bool = False, lora: AdapterSlots = NoAdapters(), cpu_decode: bool = False,
                 deterministic: bool = False) -> None:
        """`triton_decode` / `cpu_decode`: decode rows use the paged Triton kernel (CUDA) / the
        C kernel (CPU) instead of a masked SDPA over a padded gather. `lora`: the model's LoRA
        layers and slots. `deterministic`: every prompt span is attended by the C kernel as
        decode rows, so its queries get the sums decoding them would (batch invariance)."""
        self.model = model
        self.lora = lora
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.device = device
        self.triton_decode = triton_decode
        self.cpu_decode = cpu_decode
        self.deterministic = deterministic
        self.decode_graphs: DecodeGraphs | None = None  # set by the engine on CUDA
        self.direct: DirectForward | None = None  # set by the engine for Llama-shaped models without LoRA

    @property
    def decode_attention(self) -> str:
        """Which decode attention runs: "triton", "cpu" (the C kernel) or "sdpa" (over a gather)."""
        return "triton" if self.triton_decode else "cpu" if self.cpu_decode else "sdpa"

    @torch.inference_mode()
    def forward(
        self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk],
        decode_token_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, list[PromptLogitRows], list[tuple[PoolRows, torch.Tensor]]]:
        """Run one step. Returns float32 logits: first one row per sampling chunk (decodes
        first), then the prompt-logprob rows described by the returned list, then each
        verification chunk's rows for its last token and all but its last proposal. The logits
        may be a view of a CUDA graph's output buffer: valid until the next step. Last, the
        embedding sequences' rows and their final hidden states [count, hidden] in float32.
        `decode_token_ids` [D] (on the device): the decode rows' input tokens when they are
        not on the host yet (async scheduling: the previous step's samples)."""
        graphs = self.decode_graphs
        if graphs is not None and not prefills and graphs.fits(len(decodes)) and not feeds_images(decodes):
            return graphs.run(decodes, decode_token_ids), [], []
        order = self.lora.decode_order(decodes)
        if order is not None:
            decodes = [decodes[i] for i in order]
            if decode_token_ids is not None:
                decode_token_ids = decode_token_ids[torch.tensor(order, device=decode_token_ids.device)]
        inputs = self.prepare(decodes, prefills, decode_token_ids)
        with self.lora.step(decodes, prefills):
            logits, hidden = self._logits(inputs)
        if order is not None:
            logits[: len(order)] = logits[: len(order)][_inverse(order, logits.device)]
        return logits, inputs.prompt_rows, _split_pooled(inputs.pool_rows, hidden)

    def _logits(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The kept rows' logits [K, vocab] in float32, by the direct forward where it runs,
        and the final hidden states of the pooled rows [P, hidden] (None without any)."""
        pool = inputs.pool_indices
        direct = self.direct
        if direct is not None and inputs.image_embeds is None:
            if pool is None:
                return direct(inputs.input_ids, inputs.position_ids, inputs.attn_metadata,
                              inputs.logits_indices)[0].float(), None
            x = direct.run_layers(direct.embed_ids(inputs.input_ids), inputs.position_ids, inputs.attn_metadata)
            return direct.head(x, inputs.logits_indices)[0].float(), direct.final_norm(x[pool]).float()
        if inputs.image_embeds is None:
            feed = {"input_ids": inputs.input_ids}
        else:
            feed = {"inputs_embeds": self._embeds_with_images(inputs)}
        with final_hidden_states(self.model, capture=pool is not None) as captured:
            out = self.model(**feed, position_ids=inputs.position_ids, attn_metadata=inputs.attn_metadata,
                             logits_to_keep=inputs.logits_indices, use_cache=False)
        hidden = captured[0][0, pool].float() if pool is not None else None
        return out.logits[0].float(), hidden

    def encode_images(self, images: ImageInputs) -> ImageFeatures:
        return encode_images(self.model, images, self.device)

    def _embeds_with_images(self, inputs: ModelInputs) -> torch.Tensor:
        index = inputs.image_indices
        ids = inputs.input_ids.clone()
        ids[0, index] = 0  # a placeholder id may lie outside the text embedding table
        embeds = self.model.get_input_embeddings()(ids)
        embeds[0, index] = inputs.image_embeds.to(embeds.dtype)
        return embeds

    def prepare(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk],
                decode_token_ids: torch.Tensor | None = None) -> ModelInputs:
        """`decode_token_ids`: see forward()."""
        token_ids, positions, slots = decode_rows(decodes, self.block_size, decode_token_ids is None)
        images = ImageRows()
        for row, chunk in enumerate(decodes):
            images.add(chunk.seq, positions[row], 1, row)
        decode_ctx_lens = [p + 1 for p in positions]
        pos_parts = [torch.tensor(positions, dtype=torch.long)]
        slot_parts = [torch.tensor(slots, dtype=torch.long)]
        logits_indices = list(range(len(decodes)))
        prompt_indices: list[int] = []
        prompt_rows: list[PromptLogitRows] = []
        spans: list[PrefillSpan] = []
        draft_indices: list[int] = []  # speculative decoding: rows that check a chunk's proposals
        pools: list[PoolRows] = []  # embedding sequences' rows
        pool_indices: list[int] = []
        offset = len(decodes)
        for chunk in prefills:
            seq, n = chunk.seq, chunk.num_tokens
            start = seq.num_computed_tokens
            images.add(seq, start, n, offset)
            token_ids.extend(chunk.fed_token_ids())
            draft_indices.extend(range(offset, offset + len(chunk.draft)))
            all_pos = torch.arange(start + n)
            all_slots = self._slots(seq.block_table, all_pos)
            pos_parts.append(all_pos[start:])
            slot_parts.append(all_slots[start:])
            spans.append(self._prefill_span(offset, start, n, all_slots))
            rows = prompt_logprob_rows(seq, start, n)
            if rows is not None:
                prompt_rows.append(rows)
                prompt_indices.extend(range(offset + rows.first_position - start, offset + rows.first_position - start + rows.count))
            pooled = pool_rows(chunk)
            if pooled is not None:
                pools.append(pooled)
                pool_indices.extend(range(offset + n - pooled.count, offset + n))
            offset += n
            if chunk.samples:
                logits_indices.append(offset - 1)
        device = self.device
        metadata = AttentionMetadata(
            kv_cache=self.kv_cache,
            slot_mapping=torch.cat(slot_parts).to(device),
            num_decode_tokens=len(decodes),
            decode_blocks=None,
            decode_mask=None,
            prefills=spans,
            triton_decode=self.triton_decode,
            cpu_decode=self.cpu_decode,  # also short prefill spans (attention.KERNEL_SPAN)
            kernel_span=sys.maxsize if self.deterministic else KERNEL_SPAN,
        )
        self._add_decode_context(metadata, decodes, decode_ctx_lens)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=device).unsqueeze(0)
        if decode_token_ids is not None:
            input_ids[0, : len(decodes)] = decode_token_ids
        return ModelInputs(
            input_ids=input_ids,
            position_ids=torch.cat(pos_parts).to(device).unsqueeze(0),
            logits_indices=torch.tensor(logits_indices + prompt_indices + draft_indices, dtype=torch.long,
                                        device=device),
            attn_metadata=metadata,
            prompt_rows=prompt_rows,
            pool_rows=pools,
            pool_indices=torch.tensor(pool_indices, dtype=torch.long, device=device) if pools else None,
            **images.tensors(device),
        )

    def _slots(self, block_table: list[int], positions: torch.Tensor) -> torch.Tensor:
        table = torch.tensor(block_table, dtype=torch.long)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    def _prefill_span(self, offset: int, start: int, n: int, all_slots: torch.Tensor) -> PrefillSpan:
        if start == 0 and not self.deterministic:
            return PrefillSpan(offset, offset + n, None, None)
        # Earlier context is in the cache (chunked prefill or resume): attend to it too.
        q_pos = torch.arange(start, start + n).unsqueeze(1)
        k_pos = torch.arange(start + n).unsqueeze(0)
        mask = (k_pos <= q_pos).to(self.device)
        return PrefillSpan(offset, offset + n, all_slots.to(self.device), mask)

    def _add_decode_context(self, meta: AttentionMetadata, decodes: list[ScheduledChunk],
                            ctx_lens: list[int]) -> None:
        """The decode rows' block tables [D, W] and context lengths [D], and for the SDPA
        path a context mask [D, 1, 1, W * block_size]."""
        if not decodes:
            return
        tables = decode_block_tables(decodes, ctx_lens, self.block_size)
        lens = torch.tensor(ctx_lens, dtype=torch.int32)
        meta.decode_blocks = tables.to(self.device)
        meta.decode_context_lens = lens.to(self.device)
        if self.triton_decode or self.cpu_decode:
            return  # the kernels need no mask
        width = tables.shape[1] * self.block_size
        mask = torch.arange(width).unsqueeze(0) < lens.unsqueeze(1)
        meta.decode_mask = mask.view(len(decodes), 1, 1, width).to(self.device)


def _split_pooled(rows: list[PoolRows], hidden: torch.Tensor | None) -> list[tuple[PoolRows, torch.Tensor]]:
    """Each embedding chunk's rows of the pooled hidden states."""
    if hidden is None:
        return []
    return list(zip(rows, hidden.split([r.count for r in rows])))


@contextmanager
def final_hidden_states(model: torch.nn.Module, capture: bool) -> Iterator[list[torch.Tensor]]:
    """While a transformers forward runs, the output of its decoder's final norm (the hidden
    states the LM head reads, [1, T, hidden]) lands in the yielded list; `capture` False:
    nothing is hooked."""
    captured: list[torch.Tensor] = []
    if not capture:
        yield captured
        return
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm to read embeddings from")
    handle = norm.register_forward_hook(lambda _module, _args, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def _inverse(order: list[int], device: torch.device) -> torch.Tensor:
    """Row i of the sorted step is row order[i] of the caller's: where each caller's row went."""
    return torch.argsort(torch.tensor(order)).to(device)
