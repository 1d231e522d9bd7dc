"""Paged attention against dense attention: the op alone, and the whole tiny model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from tests.support.engines import complete_step
from workers.contract.sampling_params import SamplingParams
from workers.core.batch import ScheduledChunk
from workers.core.sequence import Sequence
from workers.engine.block_manager import BlockManager
from workers.engine.scheduler import Scheduler, SchedulerConfig
from workers.model.attention import paged_attention
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.runner import ModelRunner

CPU = torch.device("cpu")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).norm() / ref.norm())


def dense_causal_attention(q, k, v, q_positions, scale, window=None, softcap=None):
    """Reference: q [H, n, Dh] at absolute positions q_positions, k/v [KVH, L, Dh] (all positions);
    `window` W: a query sees keys (p - W, p]; `softcap` c: scores -> c * tanh(scores / c)."""
    rep = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(rep, dim=0).double()
    v = v.repeat_interleave(rep, dim=0).double()
    scores = torch.einsum("hqd,hkd->hqk", q.double(), k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    kpos = torch.arange(k.shape[1]).unsqueeze(0)
    qpos = torch.tensor(q_positions).unsqueeze(1)
    allowed = (kpos <= qpos) & (kpos > qpos - (window or k.shape[1] + 1))  # [n, L]
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,hkd->hqd", scores.softmax(-1), v).float()  # [H, n, Dh]


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx


# (window, softcap): plain; Mistral-style sliding window; Gemma-2-style soft cap; both.
# Decode rows by SDPA over a gather, and by the C kernel (cpu_attention.c).
@pytest.mark.parametrize("cpu_decode", [False, True], ids=["sdpa", "cpu_kernel"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 2.0), (5, 1.5)])
def test_paged_attention_mixed_batch_matches_dense(window, softcap, cpu_decode):
    torch.manual_seed(0)
    rng = random.Random(0)
    heads, kv_heads, head_dim, block_size, num_blocks = 4, 2, 8, 4, 24
    shape = KVCacheShape(num_layers=2, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32)
    cache = PagedKVCache(shape, num_blocks, block_size, CPU)
    # Garbage everywhere: a wrong slot or a missing mask shows up in the output.
    cache.keys.normal_(0, 10)
    cache.values.normal_(0, 10)
    layer = 1

    # (cached context length, new tokens): two decodes, a fresh prefill, a prefill chunk with context.
    specs = {"dec_a": (6, 1), "dec_b": (1, 1), "dec_c": (13, 1), "pre_new": (0, 5), "pre_ctx": (7, 4)}
    free_blocks = list(range(num_blocks))
    rng.shuffle(free_blocks)  # non-contiguous, out-of-order block tables
    seqs, dense = {}, {}
    k_cache, v_cache = cache.layer(layer)
    for i, (name, (ctx, n)) in enumerate(specs.items()):
        total = ctx + n
        seq = Sequence(i, list(range(total)), SamplingParams(), frozenset(), 1000)
        seq.num_computed_tokens = ctx
        seq.block_table = [free_blocks.pop() for _ in range(-(-total // block_size))]
        k_full = torch.randn(kv_heads, total, head_dim)
        v_full = torch.randn(kv_heads, total, head_dim)
        q_new = torch.randn(heads, n, head_dim)
        for p in range(ctx):  # the earlier context is already in the cache
            slot = seq.block_table[p // block_size] * block_size + p % block_size
            k_cache[slot] = k_full[:, p]
            v_cache[slot] = v_full[:, p]
        seqs[name], dense[name] = seq, (k_full, v_full, q_new)
    seqs["dec_a"].block_table.append(free_blocks.pop())  # a block reserved past its context (garbage)

    runner = ModelRunner(model=None, kv_cache=cache, device=CPU, cpu_decode=cpu_decode)
    decode_names = ["dec_a", "dec_b", "dec_c"]
    prefill_names = ["pre_new", "pre_ctx"]
    decodes = [ScheduledChunk.of(seqs[n], 1) for n in decode_names]
    prefills = [ScheduledChunk.of(seqs[n], specs[n][1]) for n in prefill_names]
    meta = runner.prepare(decodes, prefills).attn_metadata
    assert meta.num_decode_tokens == 3
    assert meta.cpu_decode == cpu_decode and (meta.decode_mask is None) == cpu_decode

    order = decode_names + prefill_names
    q = torch.cat([dense[n][2] for n in order], dim=1).unsqueeze(0)  # [1, H, T, Dh]
    k = torch.cat([dense[n][0][:, specs[n][0] :] for n in order], dim=1).unsqueeze(0)  # new tokens only
    v = torch.cat([dense[n][1][:, specs[n][0] :] for n in order], dim=1).unsqueeze(0)
    scale = 1 / math.sqrt(head_dim)
    out, weights = paged_attention(_Layer(layer), q, k, v, None, scaling=scale, attn_metadata=meta,
                                   sliding_window=window, softcap=softcap)
    assert weights is None
    assert out.shape == (1, q.shape[2], heads, head_dim)

    offset = 0
    for name in order:
        ctx, n = specs[name]
        k_full, v_full, q_new = dense[name]
        ref = dense_causal_attention(q_new, k_full, v_full, list(range(ctx, ctx + n)), scale, window, softcap)
        got = out[0, offset : offset + n].transpose(0, 1)
        assert rel_err(got, ref) < 1e-5, name
        # The new tokens' K/V were written into their own slots.
        seq = seqs[name]
        for p in range(ctx, ctx + n):
            slot = seq.block_table[p // block_size] * block_size + p % block_size
            assert torch.equal(k_cache[slot], k_full[:, p])
            assert torch.equal(v_cache[slot], v_full[:, p])
        offset += n


def test_paged_model_logits_match_dense_model(tiny_model, paged_model):
    """Teacher-forced through the scheduler and model runner (chunked prefills, decodes, mixed
    batches) the paged model gives the dense model's logits at every position."""
    rng = random.Random(1)
    vocab = tiny_model.config.vocab_size
    lengths = [(1, 9), (5, 14), (17, 23), (3, 4), (11, 30)]  # (prompt length, full length)
    full = [[rng.randrange(3, vocab) for _ in range(total)] for _, total in lengths]

    with torch.no_grad():
        reference = [tiny_model(torch.tensor([ids])).logits[0].float() for ids in full]

    shape = KVCacheShape.from_model_config(paged_model.config, torch.float32)
    cache = PagedKVCache(shape, num_blocks=40, block_size=4, device=CPU)
    runner = ModelRunner(paged_model, cache, CPU)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=7), BlockManager(40, 4))
    seqs = []
    for i, ((prompt_len, total), ids) in enumerate(zip(lengths, full)):
        params = SamplingParams(max_tokens=total - prompt_len, ignore_eos=True)
        seq = Sequence(i, ids[:prompt_len], params, frozenset(), 1000)
        seqs.append(seq)
        sched.add(seq)

    got: dict[tuple[int, int], torch.Tensor] = {}
    mixed_steps = 0
    while sched.has_work():
        batch = sched.schedule()
        logits, _, _ = runner.forward(batch.decodes, batch.prefills)
        chunks = batch.sampling_chunks
        assert logits.shape == (len(chunks), vocab)
        mixed_steps += bool(batch.decodes and batch.prefills)
        teacher = []
        for row, chunk in enumerate(chunks):
            seq = chunk.seq
            pos = seq.num_tokens - 1
            got[(seq.seq_id, pos)] = logits[row]
            teacher.append(full[seq.seq_id][pos + 1])
        complete_step(sched, batch, teacher)
    assert mixed_steps > 0

    for seq, (prompt_len, total) in zip(seqs, lengths):
        assert seq.token_ids == full[seq.seq_id]
        positions = list(range(prompt_len - 1, total - 1))
        assert sorted(p for s, p in got if s == seq.seq_id) == positions
        paged = torch.stack([got[(seq.seq_id, p)] for p in positions])
        dense_ref = reference[seq.seq_id][positions]
        assert rel_err(paged, dense_ref) < 1e-5
        assert torch.equal(paged.argmax(-1), dense_ref.argmax(-1))
