"""The C decode attention (cpu_attention.c) against SDPA over the gathered context: every
dtype it takes, grouped heads, head sizes on and off its vector path, sliding windows and
soft caps; and its promise that a row's result depends on nothing but that row."""

from __future__ import annotations

import pytest
import torch

from tests.unit.model.test_attention import dense_causal_attention, rel_err
from workers.contract.sampling_params import SamplingParams
from workers.core.batch import ScheduledChunk
from workers.core.sequence import Sequence
from workers.model import cpu_attention
from workers.model.attention import LayerAttention, attend_packed
from workers.model.cpu_attention import CpuDecodeAttention, cpu_decode_attention
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.runner import ModelRunner

kernel = cpu_decode_attention()
pytestmark = pytest.mark.skipif(kernel is None, reason="no C compiler to build cpu_attention.c")

BLOCK = 16


def _case(dtype, lens, heads=6, kv_heads=2, head_dim=64, seed=0):
    """Random q, caches holding each sequence's context in shuffled blocks, tables, lens."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // BLOCK) for n in lens)
    num_blocks = len(lens) * width + 3
    order = torch.randperm(num_blocks, generator=gen)
    tables = order[: len(lens) * width].view(len(lens), width).contiguous()
    k = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_blocks * BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _context(cache, table, n):
    slots = (table.view(-1, 1) * BLOCK + torch.arange(BLOCK)).view(-1)[:n]
    return cache[slots].transpose(0, 1)  # [KVH, n, Dh]


def _run(q, k, v, tables, lens, scale, window=None, softcap=None, threads=None):
    out = torch.empty_like(q)
    previous = torch.get_num_threads()
    try:
        if threads is not None:
            torch.set_num_threads(threads)
        assert kernel(q, k, v, tables, lens, BLOCK, scale, window, softcap, out)
    finally:
        torch.set_num_threads(previous)
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("head_dim", [64, 12])  # 12: not a multiple of 8 (the scalar loop)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0)])
def test_kernel_matches_dense_attention(dtype, tolerance, head_dim, window, softcap):
    lens = [1, 15, 16, 17, 70, 600]  # 600: three partitions of keys, merged
    q, k, v, tables, lens_t = _case(dtype, lens, head_dim=head_dim)
    scale = head_dim**-0.5
    out = _run(q, k, v, tables, lens_t, scale, window, softcap)
    for row, n in enumerate(lens):
        ref = dense_causal_attention(q[row].float().unsqueeze(1), _context(k, tables[row], n).float(),
                                     _context(v, tables[row], n).float(), [n - 1], scale, window, softcap)
        assert rel_err(out[row].float(), ref[:, 0]) < tolerance, (row, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_result_depends_only_on_its_own_context(dtype):
    """Alone or among others, in any position of the batch, on 1 or 2 threads: bit for bit."""
    lens = [33, 5, 600, 64, 900]  # enough work that the kernel runs its tasks on a team
    q, k, v, tables, lens_t = _case(dtype, lens, heads=9, kv_heads=3)
    batch = _run(q, k, v, tables, lens_t, 0.125)
    flipped = _run(q.flip(0), k, v, tables.flip(0), lens_t.flip(0), 0.125, threads=1)
    assert torch.equal(flipped.flip(0), batch)
    for row in range(len(lens)):
        alone = _run(q[row : row + 1], k, v, tables[row : row + 1], lens_t[row : row + 1], 0.125, threads=2)
        assert torch.equal(alone[0], batch[row])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 40])
def test_a_prompts_queries_tiled_equal_each_query_alone(dtype, window):
    """A prompt's consecutive queries as decode rows (one block table, lengths one apart) are
    attended in tiles sharing each block's reads: bit for bit what each row gives alone,
    across partitions (runs that start mid-partition, rows with fewer partitions than the
    tile's last), beside another sequence's rows, and under a window (no tiles)."""
    q, k, v, tables, _ = _case(dtype, [300] * 2, heads=9, kv_heads=3)
    span = list(range(230, 300))  # 70 queries: the tile crossing 256 keys holds rows of 1 and 2 partitions
    rows = [(0, n) for n in span[:33]] + [(1, 77), (1, 3)] + [(0, n) for n in span[33:]]
    table_rows = torch.stack([tables[seq] for seq, _ in rows])
    lens = torch.tensor([n for _, n in rows], dtype=torch.int32)
    queries = torch.randn(len(rows), 9, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    together = _run(queries, k, v, table_rows, lens, 0.125, window)
    for row in range(len(rows)):
        alone = _run(queries[row : row + 1], k, v, table_rows[row : row + 1], lens[row : row + 1], 0.125, window)
        assert torch.equal(alone[0], together[row]), row


def test_strided_queries_and_refusals():
    q, k, v, tables, lens = _case(torch.float32, [9, 40])
    packed = torch.cat((q, torch.randn(2, 2, 64)), dim=1)  # q heads beside k heads, as the direct forward has them
    strided = packed[:, :6]
    assert torch.equal(_run(strided, k, v, tables, lens, 0.1), _run(q.contiguous(), k, v, tables, lens, 0.1))
    out = torch.empty_like(q)
    assert not kernel(q.double(), k.double(), v.double(), tables, lens, BLOCK, 0.1, None, None, out.double())
    assert not kernel(q, k, v, tables.int(), lens, BLOCK, 0.1, None, None, out)  # tables must be int64


def test_portable_build_computes_what_the_native_one_does(tmp_path):
    """Built for a plain x86-64 (no AVX2, no F16C: float16 is refused there): the loops
    such a CPU runs, equal to the native build's up to float rounding."""
    import ctypes
    import platform
    import subprocess

    arch = ["-march=x86-64"] if platform.machine() == "x86_64" else []
    target = tmp_path / "portable.so"
    subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", *arch, "-o", str(target),
                    str(cpu_attention.SOURCE)], check=True, capture_output=True, timeout=120)
    portable = CpuDecodeAttention(ctypes.CDLL(str(target)))
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        q, k, v, tables, lens = _case(dtype, [3, 31, 50], head_dim=32)
        out = torch.empty_like(q)
        assert portable(q, k, v, tables, lens, BLOCK, 0.2, 24, 3.0, out)
        assert rel_err(out.float(), _run(q, k, v, tables, lens, 0.2, 24, 3.0).float()) < tolerance


def test_a_short_span_computes_what_decode_steps_compute():
    """A chunk of 4 tokens with earlier context (a speculative verification) through the
    C kernel as decode rows: each query's output is bit for bit the one a decode step at
    its position gives."""
    heads, kv_heads, head_dim, block_size, context, new = 6, 2, 16, 4, 21, 4
    cache = PagedKVCache(KVCacheShape(num_layers=1, num_kv_heads=kv_heads, head_dim=head_dim, dtype=torch.float32),
                         num_blocks=16, block_size=block_size, device=torch.device("cpu"))
    cache.keys.normal_()
    cache.values.normal_()
    runner = ModelRunner(model=None, kv_cache=cache, device=torch.device("cpu"), cpu_decode=True)
    seq = Sequence(0, list(range(context + new)), SamplingParams(), frozenset(), 1000)
    seq.block_table = [11, 3, 7, 0, 9, 14, 5]
    q, k, v = torch.randn(new, heads, head_dim), torch.randn(new, kv_heads, head_dim), torch.randn(new, kv_heads, head_dim)
    layer = LayerAttention(head_dim**-0.5, None, None)
    seq.num_computed_tokens = context
    span = attend_packed(0, q, k, v, runner.prepare([], [ScheduledChunk.of(seq, new)]).attn_metadata, layer)
    for i in range(new):
        seq.num_computed_tokens = context + i
        meta = runner.prepare([ScheduledChunk.of(seq, 1)], []).attn_metadata
        decoded = attend_packed(0, q[i : i + 1], k[i : i + 1], v[i : i + 1], meta, layer)
        assert torch.equal(decoded[0], span[i]), i


@pytest.mark.parametrize("tokens", [1, 5, 300])  # 300: rows split over the threads
def test_rotation_and_cache_write_are_torchs_bits(tokens):
    """q and k heads rotated in place as the direct forward's torch operators rotate them
    (the same bits: no fused multiply-add), v untouched; every token's k and v at its slot."""
    heads, kv_heads, head_dim = 6, 2, 64
    gen = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=gen)
    angles = torch.rand(tokens, head_dim, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    signed_sin = torch.cat((-sin[:, :32], sin[:, 32:]), dim=-1)
    qk = qkv[:, :heads + kv_heads]
    want = qk * cos.unsqueeze(1) + qk.roll(32, -1) * signed_sin.unsqueeze(1)
    slots = torch.randperm(tokens + 7, generator=gen)[:tokens]
    k_cache, v_cache = torch.zeros(tokens + 7, kv_heads, head_dim), torch.zeros(tokens + 7, kv_heads, head_dim)
    rotated = qkv.clone()
    assert kernel.rotate_and_cache(rotated, heads, kv_heads, cos, signed_sin, slots, k_cache, v_cache)
    assert torch.equal(rotated[:, :heads + kv_heads], want)
    assert torch.equal(rotated[:, heads + kv_heads:], qkv[:, heads + kv_heads:])
    assert torch.equal(k_cache[slots], want[:, heads:]) and torch.equal(v_cache[slots], qkv[:, heads + kv_heads:])
    assert not kernel.rotate_and_cache(rotated.double(), heads, kv_heads, cos, signed_sin, slots, k_cache, v_cache)
    outside = slots.clone()
    outside[-1] = tokens + 7  # one past the caches' last slot: refused before anything is written
    before = rotated.clone()
    assert not kernel.rotate_and_cache(rotated, heads, kv_heads, cos, signed_sin, outside, k_cache, v_cache)
    assert torch.equal(rotated, before)
