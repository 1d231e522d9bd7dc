"""Paged attention, plugged into transformers through its attention interface.

The model runner packs every scheduled sequence into one `[1, total_tokens]` row with
explicit position ids, and passes an `AttentionMetadata` through the model's forward
kwargs. Each attention layer then calls `paged_attention`, which
1. writes the new tokens' K/V into their cache slots, and
2. attends each query token to its own sequence's cached context only.
Decode tokens (one query each) are attended in one batch by a paged kernel that reads
each context straight from the cache: on CUDA with Triton (triton_attention.py; it also
runs inside the decode CUDA graphs), on CPU in C (cpu_attention.c); where neither is
available, by one SDPA call over a padded gather of their context. Prefill chunks are
attended one sequence at a time (on CPU a short one with earlier context, such as a
speculative verification, by the C kernel as decode rows).
Because the hook is transformers' own `AttentionInterface`, every causal LM that
transformers defines runs on this cache without a model rewrite. The hook's work is
`attend_packed`, in the packed `[T, heads, head_dim]` layout, which the direct forward of
Llama-shaped models (direct_forward.py) calls without transformers' modules around it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from workers.model.cpu_attention import CpuDecodeAttention, cpu_decode_attention
from workers.model.kv_cache import PagedKVCache
from workers.model.triton_attention import paged_decode_attention

ATTN_IMPLEMENTATION = "chatserve_paged"


# A span with earlier context of at most this many queries (a speculative verification, a
# short chunk, the tail after a prefix-cache hit) is attended as that many decode rows by
# the C kernel: one call over the cache in place instead of gathering the whole context
# for SDPA, and each query's sums the same as had it been decoded. Longer spans (a long
# prompt's chunks) take SDPA: the kernel runs each query on its own, and where that stops
# paying has not been measured.
KERNEL_SPAN = 16


@dataclass
class PrefillSpan:
    """A run of query tokens of one sequence inside the packed batch."""

    start: int  # first index in the packed batch
    end: int  # one past the last index
    context_slots: torch.Tensor | None  # slots of positions [0, end_pos); None: no earlier context
    mask: torch.Tensor | None  # [q_len, kv_len] bool, True = attend; with context_slots
    # Its queries as decode rows for the C kernel ([n, W] block tables, [n] context
    # lengths), made by the first layer that needs them.
    kernel_rows: tuple[torch.Tensor, torch.Tensor] | None = None

    def as_decode_rows(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.kernel_rows is None:
            n, total = self.end - self.start, self.context_slots.shape[0]
            blocks = torch.div(self.context_slots[::block_size], block_size, rounding_mode="floor")
            lens = torch.arange(total - n + 1, total + 1, dtype=torch.int32, device=blocks.device)
            self.kernel_rows = (blocks.expand(n, -1).contiguous(), lens)
        return self.kernel_rows


@dataclass
class AttentionMetadata:
    kv_cache: PagedKVCache
    slot_mapping: torch.Tensor  # [T]: cache slot of each packed token
    num_decode_tokens: int  # the first `num_decode_tokens` packed tokens are decodes
    decode_blocks: torch.Tensor | None  # [D, W]: each decode sequence's block table, padded to W blocks
    decode_mask: torch.Tensor | None  # [D, 1, 1, W * block_size] bool: its context, not the padding (SDPA path;
    # None: made from decode_context_lens when needed)
    prefills: list[PrefillSpan]
    decode_context_lens: torch.Tensor | None = None  # [D] int32: each decode row's context, itself included
    triton_decode: bool = False  # decode rows by the Triton kernel (CUDA)
    cpu_decode: bool = False  # decode rows by the C kernel (CPU); neither: SDPA over a gather
    kernel_span: int = KERNEL_SPAN  # with cpu_decode: spans (with their context) of up to this many queries too


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention call asks beyond plain causal attention (transformers
    passes these per layer: Gemma 2/3 alternate local and global layers)."""

    scale: float
    window: int | None  # sliding window: a query sees itself and the window - 1 keys before it
    softcap: float | None  # logits become softcap * tanh(logits / softcap) (Gemma 2)

    @classmethod
    def of(cls, head_dim: int, scaling: float | None, kwargs: dict) -> "LayerAttention":
        if kwargs.get("s_aux") is not None:
            raise NotImplementedError("attention sinks (s_aux, as gpt-oss has) are not supported by the paged attention")
        scale = scaling if scaling is not None else head_dim**-0.5
        return cls(scale, kwargs.get("sliding_window") or None, kwargs.get("softcap") or None)


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
    """transformers' attention hook: query [1, H, T, Dh], key/value [1, KVH, T, Dh] (after
    RoPE) -> ([1, T, H, Dh], None)."""
    layer = LayerAttention.of(query.shape[-1], scaling, kwargs)
    out = attend_packed(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                        value[0].transpose(0, 1), kwargs["attn_metadata"], layer)
    return out.unsqueeze(0), None


def attend_packed(layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                  layer: LayerAttention, cached: bool = False) -> torch.Tensor:
    """One layer's attention over the packed batch, in the packed layout: q [T, H, Dh] and
    the new tokens' k/v [T, KVH, Dh] -> [T, H, Dh]. Writes k/v into their cache slots first
    (unless `cached`: the caller wrote them)."""
    k_cache, v_cache = meta.kv_cache.layer(layer_idx)
    if not cached:
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
    out = q.new_empty(q.shape)
    num_decode = meta.num_decode_tokens
    kernel = cpu_decode_attention() if meta.cpu_decode else None
    if num_decode:
        _attend_decodes(q[:num_decode], k_cache, v_cache, meta, layer, out[:num_decode], kernel)
    for span in meta.prefills:
        if kernel is not None and _span_by_kernel(kernel, q, k_cache, v_cache, span, meta, layer, out):
            continue
        qp = q[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, Dh]
        if span.context_slots is None:
            kp = k[span.start : span.end].transpose(0, 1).unsqueeze(0)  # [1, KVH, kv, Dh]
            vp = v[span.start : span.end].transpose(0, 1).unsqueeze(0)
        else:
            kp = k_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
            vp = v_cache[span.context_slots].transpose(0, 1).unsqueeze(0)
        mask = span.mask
        if layer.window is not None:
            mask = _causal_mask(qp.shape[2], kp.shape[2], q.device, layer.window)
        out[span.start : span.end] = _attend(qp, kp, vp, mask, layer)[0].transpose(0, 1)
    return out


def _span_by_kernel(kernel: CpuDecodeAttention, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    span: PrefillSpan, meta: AttentionMetadata, layer: LayerAttention, out: torch.Tensor) -> bool:
    """A short span with earlier context as decode rows of the C kernel (KERNEL_SPAN; in the
    deterministic mode every span, its context slots then given even without earlier
    context); False when it is not one, or the kernel does not take it."""
    if span.context_slots is None or span.end - span.start > meta.kernel_span:
        return False
    block_size = meta.kv_cache.block_size
    return kernel(q[span.start : span.end], k_cache, v_cache, *span.as_decode_rows(block_size), block_size,
                  layer.scale, layer.window, layer.softcap, out[span.start : span.end])


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    layer: LayerAttention, out: torch.Tensor, kernel: CpuDecodeAttention | None) -> None:
    """q [D, H, Dh] (one query per decode row) -> out [D, H, Dh]."""
    block_size = meta.kv_cache.block_size
    if meta.triton_decode:
        paged_decode_attention(q, k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens,
                               block_size, layer.scale, out=out, sliding_window=layer.window, softcap=layer.softcap)
        return
    if kernel is not None and kernel(q, k_cache, v_cache, meta.decode_blocks, meta.decode_context_lens, block_size,
                                     layer.scale, layer.window, layer.softcap, out):
        return
    qd = q.unsqueeze(2)  # [D, H, 1, Dh]
    kd = _gather_blocks(k_cache, meta.decode_blocks, block_size)  # [D, KVH, W*bs, Dh]
    vd = _gather_blocks(v_cache, meta.decode_blocks, block_size)
    mask = meta.decode_mask
    if mask is None:
        positions = torch.arange(kd.shape[2], device=q.device)
        mask = (positions < meta.decode_context_lens.unsqueeze(1)).view(q.shape[0], 1, 1, -1)
    if layer.window is not None:
        positions = torch.arange(mask.shape[-1], device=mask.device)
        first = (meta.decode_context_lens - layer.window).view(-1, 1, 1, 1)
        mask = mask & (positions >= first)
    out.copy_(_attend(qd, kd, vd, mask, layer).squeeze(2))


def _causal_mask(q_len: int, kv_len: int, device: torch.device, window: int | None = None) -> torch.Tensor:
    """[q, kv] bool: causal, and within the sliding window if any; the queries are the
    last q_len positions."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device).unsqueeze(1)
    k_pos = torch.arange(kv_len, device=device).unsqueeze(0)
    allowed = k_pos <= q_pos
    return allowed if window is None else allowed & (k_pos > q_pos - window)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            layer: LayerAttention) -> torch.Tensor:
    """q [B, H, q, Dh] over k/v [B, KVH, kv, Dh]; mask None = causal (queries last)."""
    if layer.softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                              enable_gqa=True)
    # SDPA has no logit soft cap: the plain math, as transformers' eager attention does it.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, k.transpose(-1, -2)) * layer.scale / layer.softcap) * layer.softcap
    if mask is None:
        mask = _causal_mask(q.shape[2], k.shape[2], q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(v.dtype), v)


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
