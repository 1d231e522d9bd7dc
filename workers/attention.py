"""Paged attention, plugged into transformers through its attention interface.

The model runner packs every scheduled sequence into one `[1, total_tokens]` row with
explicit position ids, and passes an `AttentionMetadata` through the model's forward
kwargs. Each attention layer then calls `paged_attention`, which
1. writes the new tokens' K/V into their cache slots, and
2. attends each query token to its own sequence's cached context only.
Decode tokens (one query each) are attended in one batch: on CUDA with Triton by a
paged kernel that reads each context straight from the cache (triton_attention.py; it
also runs inside the decode CUDA graphs), elsewhere by one SDPA call over a padded gather
of their context. Prefill chunks are attended one sequence at a time.
Because the hook is transformers' own `AttentionInterface`, every causal LM that
transformers defines runs on this cache without a model rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from workers.kv_cache import PagedKVCache
from workers.triton_attention import paged_decode_attention

ATTN_IMPLEMENTATION = "chatserve_paged"


@dataclass
class PrefillSpan:
    """A run of query tokens of one sequence inside the packed batch."""

    start: int  # first index in the packed batch
    end: int  # one past the last index
    context_slots: torch.Tensor | None  # slots of positions [0, end_pos); None: no earlier context
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = attend; with context_slots


@dataclass
class AttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T]: cache slot of each packed token
    num_decode_tokens: int  # the first `num_decode_tokens` packed tokens are decodes
    decode_blocks: torch.Tensor | None  # [D, W]: each decode sequence's block table, padded to W blocks
    decode_mask: torch.Tensor | None  # [D, 1, 1, W * block_size] bool: its context, not the padding (SDPA path)
    prefills: list[PrefillSpan]
    decode_context_lens: torch.Tensor | None = None  # [D] int32: set for the Triton path (then no mask)


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    meta: AttentionMetadata = kwargs["attn_metadata"]
    k_cache, v_cache = meta.kv_cache.layer(module.layer_idx)
    # query: [1, H, T, Dh]; key/value: [1, KVH, T, Dh] (after RoPE).
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, meta.slot_mapping, new_k)
    v_cache.index_copy_(0, meta.slot_mapping, new_v)

    q = query[0]  # [H, T, Dh]
    out = q.new_empty(q.shape[1], q.shape[0], q.shape[2])  # [T, H, Dh]
    num_decode = meta.num_decode_tokens
    if num_decode and meta.decode_context_lens is not None:
        paged_decode_attention(
            q[:, :num_decode].transpose(0, 1), k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens,
            meta.kv_cache.block_size, scaling if scaling is not None else q.shape[-1] ** -0.5, out=out[:num_decode],
        )
    elif num_decode:
        qd = q[:, :num_decode].transpose(0, 1).unsqueeze(2)  # [D, H, 1, Dh]
        kd = _gather_blocks(k_cache, meta.decode_blocks, meta.kv_cache.block_size)  # [D, KVH, W*bs, Dh]
        vd = _gather_blocks(v_cache, meta.decode_blocks, meta.kv_cache.block_size)
        od = F.scaled_dot_product_attention(
            qd, kd, vd, attn_mask=meta.decode_mask, scale=scaling, enable_gqa=True
        )
        out[:num_decode] = od.squeeze(2)
    for span in meta.prefills:
        qp = q[:, span.start : span.end].unsqueeze(0)  # [1, H, q, Dh]
        if span.context_slots is None:
            kp = key[:, :, span.start : span.end]
            vp = value[:, :, span.start : span.end]
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scaling, enable_gqa=True)
        else:
            kp = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, kv, Dh]
            vp = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        out[span.start : span.end] = op[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, KVH, Dh] cache -> [D, KVH, W * block_size, Dh] for a [D, W] block table.
    Whole blocks are copied (block_size tokens at a time): 1.7x faster than gathering
    token slots one by one (64 sequences x 76 tokens, SmolLM2's 3 x 64 heads)."""
    num_seqs, width = blocks.shape
    paged = cache.view(-1, block_size, *cache.shape[1:])
    gathered = paged.index_select(0, blocks.reshape(-1))
    return gathered.view(num_seqs, width * block_size, *cache.shape[1:]).transpose(1, 2)


def _no_mask(*args, **kwargs) -> None:
    # Masks come from AttentionMetadata; skip transformers' dense [T, T] mask build.
    return None


def register_paged_attention() -> str:
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    return ATTN_IMPLEMENTATION
