"""Paged-KV decode attention as one Triton kernel (CUDA).

Decode is memory-bound: each query token does little math per K/V byte. The kernel reads
every context token's K/V exactly once, straight from the paged cache through the block
table, instead of gathering a padded dense copy of the context first (which reads it,
writes it, and reads it again). It never syncs with the host (the loop bound is each
sequence's context length, loaded inside the kernel), so its launch can be captured in a
CUDA graph.

Few sequences leave most of the GPU idle (a grid of sequences x KV heads: 8 programs for
one sequence of a Llama-3 model on 132 SMs), so then each (sequence, KV head) is split
into up to MAX_SPLITS context ranges ("flash decoding"): each writes its partial softmax
state, and a second small kernel merges them. The split count depends only on the batch
size, and each range is a share of the row's context length read on the device, so a
captured graph serves every context length either way.

Triton is imported lazily: without it this module still imports, and `triton_available()`
is False. Under `TRITON_INTERPRET=1` (set before this module is imported) the kernel runs
on CPU tensors through Triton's interpreter, which is how the tests check it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

BLOCK_N = 64  # context tokens per tile
NUM_WARPS = 4
NUM_STAGES = 2
MAX_SPLITS = 16  # context ranges per (sequence, KV head) when the batch is small
_LOG2E = 1.4426950408889634
_NO_WINDOW = 2**31 - 1  # "no sliding window": more keys than any context
_CPU_SM_COUNT = 132  # under the interpreter (CPU tensors): as an H100, so the tests split


def triton_available() -> bool:
    """Whether the Triton kernel can run here: triton importable and a CUDA device present."""
    try:
        return triton is not None and torch.cuda.is_available()
    except Exception:
        return False


if triton is not None:

    @triton.jit
    def _dot(a, b, IEEE: tl.constexpr):
        # fp32 caches: exact fp32 products (no tf32); bf16/fp16: tensor cores, fp32 accumulation.
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
        return c

    # Grid (D, KVH, SPLITS): one program per (sequence, kv head, context range). It computes
    # all G query heads of the group at once (padded to BLOCK_G >= 16 rows so tl.dot applies),
    # so each K/V tile is loaded once per group, and walks its range in tiles of BLOCK_N
    # tokens with an online softmax (running max m, sum l, accumulator acc) in fp32. With
    # one split it writes the output; with several, its (m, l, acc) for _merge_splits_kernel.
    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, o_ptr, part_acc_ptr, part_ml_ptr,
        s_qd, s_qh, s_qe,
        s_ks, s_kh, s_ke,
        s_vs, s_vh, s_ve,
        s_td, s_tw,
        s_od, s_oh, s_oe,
        qk_scale,  # softmax scale * log2(e): the kernel uses exp2
        window,  # sliding window (a huge number when the layer has none)
        softcap,  # logit soft cap (used when SOFTCAP)
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        SPLITS: tl.constexpr, SOFTCAP: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        qo_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        heads = kvh * GROUP + g

        q = tl.load(q_ptr + seq * s_qd + heads[:, None] * s_qh + d[None, :] * s_qe, mask=qo_mask, other=0.0)
        q = q.to(k_ptr.dtype.element_ty)
        ctx_len = tl.load(ctx_ptr + seq)
        # The keys it sees: the last `window` of the context. This program's range: an equal
        # share of them, in whole tiles (split 0 is never empty; a later one may be, and then
        # leaves m = -inf, l = 0, acc = 0).
        first = tl.maximum(ctx_len - window, 0)
        per_split = tl.cdiv(tl.cdiv(ctx_len - first, SPLITS), BLOCK_N) * BLOCK_N
        lo = first + split * per_split
        hi = tl.minimum(lo + per_split, ctx_len)
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)

        for start in range(lo, hi, BLOCK_N):
            t = start + n
            t_mask = t < hi
            page = tl.load(table_ptr + seq * s_td + (t // PAGE) * s_tw, mask=t_mask, other=0)
            slot = page.to(tl.int64) * PAGE + t % PAGE
            kv_mask = t_mask[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + slot[:, None] * s_ks + kvh * s_kh + d[None, :] * s_ke, mask=kv_mask, other=0.0)
            s = _dot(q, tl.trans(k), IEEE) * qk_scale  # [BLOCK_G, BLOCK_N], log2 domain
            if SOFTCAP:  # softcap * tanh(x / softcap) on the natural-log logits x; tanh(y) = 1 - 2 / (e^2y + 1)
                y = s / (1.4426950408889634 * softcap)
                s = softcap * (1.0 - 2.0 / (tl.exp2(2.8853900817779268 * y) + 1.0)) * 1.4426950408889634
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every tile holds >= 1 context token
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + slot[:, None] * s_vs + kvh * s_vh + d[None, :] * s_ve, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, IEEE)
            m = m_new

        if SPLITS == 1:
            out = acc / l[:, None]
            tl.store(o_ptr + seq * s_od + heads[:, None] * s_oh + d[None, :] * s_oe, out.to(o_ptr.dtype.element_ty), mask=qo_mask)
        else:
            # Workspace: acc [D, H, SPLITS, BLOCK_D], (m, l) [D, H, SPLITS, 2], contiguous.
            row = (seq * GROUP * tl.num_programs(1) + heads) * SPLITS + split
            tl.store(part_acc_ptr + row[:, None] * BLOCK_D + d[None, :], acc, mask=(g < GROUP)[:, None])
            tl.store(part_ml_ptr + row * 2, m, mask=g < GROUP)
            tl.store(part_ml_ptr + row * 2 + 1, l, mask=g < GROUP)

    # Grid (D, H): merges one head's SPLITS partial states, each rescaled to the common max.
    @triton.jit
    def _merge_splits_kernel(
        part_acc_ptr, part_ml_ptr, o_ptr, s_od, s_oh, s_oe,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        sp = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        rows = (seq * tl.num_programs(1) + head) * SPLITS + sp
        s_mask = sp < SPLITS
        m = tl.load(part_ml_ptr + rows * 2, mask=s_mask, other=float("-inf"))
        l = tl.load(part_ml_ptr + rows * 2 + 1, mask=s_mask, other=0.0)
        acc = tl.load(part_acc_ptr + rows[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)
        weight = tl.exp2(m - tl.max(m, 0))  # 0 for empty splits (m = -inf); the max is finite
        out = tl.sum(acc * weight[:, None], 0) / tl.sum(l * weight, 0)
        tl.store(o_ptr + seq * s_od + head * s_oh + d * s_oe, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    query [D, H, Dh]; k_cache/v_cache [num_slots, KVH, Dh]; block_tables [D, W] (int32/64);
    context_lens [D] (>= 1, including the current token). Query head h reads kv head
    h // (H // KVH). Returns (or fills `out`) [D, H, Dh] in the query dtype.
    `num_splits`: context ranges per (sequence, KV head); default: from the batch size.
    `sliding_window` W: a query sees its own and the W - 1 earlier keys (transformers'
    sliding-window layers); `softcap` c: logits become c * tanh(logits / c) (Gemma 2).
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape[2] == head_dim and v_cache.shape == k_cache.shape
    assert block_tables.shape[0] == num_seqs and context_lens.shape == (num_seqs,)
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    assert out.shape == query.shape, (out.shape, query.shape)
    if num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    splits = num_splits or default_num_splits(num_seqs, num_kv_heads, query.device)
    block_d = max(16, triton.next_power_of_2(head_dim))
    part_acc = part_ml = out  # unused with one split
    if splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=query.device)
        part_ml = torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=query.device)
    _paged_decode_kernel[(num_seqs, num_kv_heads, splits)](
        query, k_cache, v_cache, block_tables, context_lens, out, part_acc, part_ml,
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *out.stride(),
        scale * _LOG2E, sliding_window or _NO_WINDOW, softcap or 0.0,
        GROUP=group, HEAD_DIM=head_dim, PAGE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=BLOCK_N,
        IEEE=k_cache.dtype == torch.float32,
        SPLITS=splits, SOFTCAP=bool(softcap),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc, part_ml, out, *out.stride(),
            HEAD_DIM=head_dim, BLOCK_D=block_d, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
        )  # fmt: skip
    return out


def default_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Enough context ranges that the grid holds about two programs per SM, at most
    MAX_SPLITS; 1 once the batch alone fills the GPU (a large decode batch)."""
    programs = num_seqs * num_kv_heads
    return max(1, min(MAX_SPLITS, 2 * _sm_count(device) // programs))


_SM_COUNTS: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _CPU_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]
