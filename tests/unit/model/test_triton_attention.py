"""The Triton paged decode-attention kernel, run on CPU through Triton's interpreter.

Triton decides interpreter vs. compiler when `@triton.jit` decorates a function, and its own
library helpers (`tl.zeros`, ...) are decorated when triton is first imported, which the
conftest's imports (transformers) already do. So the kernel cases run in a child pytest
started with TRITON_INTERPRET=1 from the beginning (`test_kernel_under_interpreter`); in the
parent they are skipped. Each case is checked against float64 dense attention over exactly
the sequence's context, gathered through its block table. The low-precision cases use
fp16: the interpreter's tl.dot multiplies bf16 operands as their raw uint16 bits (triton
3.9), so bf16 can only be checked on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu  # on CPU through the interpreter; on a GPU compiled

import workers.model.triton_attention as ta  # noqa: E402
from tests.support.paths import REPO_ROOT

ROOT = REPO_ROOT
BLOCK_SIZE = 16
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(not INTERPRETED, reason="run in a child by test_kernel_under_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU tests/gpu/test_gpu.py runs the kernel itself")
def test_kernel_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", __file__]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "18 passed" in result.stdout, result.stdout[-2000:]  # every kernel case ran


@pytest.mark.skipif(INTERPRETED, reason="needs a process without the interpreter")
def test_plain_import_reports_availability():
    # A normal import works; without CUDA (this CPU machine) the kernel is unavailable.
    assert type(ta._paged_decode_kernel).__name__ == "JITFunction"
    assert ta.triton_available() == torch.cuda.is_available()


def make_case(context_lens, num_kv_heads, group, head_dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    width = max(-(-n // BLOCK_SIZE) for n in context_lens) + 1  # +1: padding past every context
    num_blocks = num_seqs * width + 3
    # Shuffled, non-contiguous block ids; padding entries point at real (foreign) blocks.
    block_tables = torch.randperm(num_blocks, generator=gen)[: num_seqs * width].view(num_seqs, width)
    shape = (num_blocks * BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(num_seqs, num_kv_heads * group, head_dim, generator=gen).to(dtype)
    return query, k_cache, v_cache, block_tables, torch.tensor(context_lens)


def reference(query, k_cache, v_cache, block_tables, context_lens, scale, window=None, softcap=None):
    group = query.shape[1] // k_cache.shape[1]
    out = []
    for i, n in enumerate(context_lens.tolist()):
        t = torch.arange(max(0, n - window) if window else 0, n)  # the keys a sliding window keeps
        slots = block_tables[i, t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
        k = k_cache[slots].double().repeat_interleave(group, dim=1)  # [n, H, Dh]
        v = v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", query[i].double(), k).mul(scale)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        probs = scores.softmax(-1)
        out.append(torch.einsum("hn,nhd->hd", probs, v))
    return torch.stack(out)


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


CONTEXTS = [1, 16, 150, 37, 64, 129]


SHAPES = [(4, 64, torch.float32, 1e-5), (1, 64, torch.float32, 1e-5), (4, 80, torch.float32, 1e-5),
          (4, 64, torch.float16, 1e-3), (1, 80, torch.float16, 1e-3)]


@interpreted_only
@pytest.mark.parametrize(
    "group, head_dim, dtype, tol, splits",
    # Every shape whole and in 3 context ranges (a context of 1 leaves two ranges empty);
    # None: the count from the batch size (16 here: a small batch) for one shape per dtype,
    # since each of those costs ~3 s interpreted.
    [(*shape, splits) for shape in SHAPES for splits in (1, 3)] + [(*SHAPES[0], None), (*SHAPES[4], None)],
)
def test_matches_dense_reference(group, head_dim, dtype, tol, splits):
    query, k_cache, v_cache, tables, lens = make_case(CONTEXTS, 2, group, head_dim, dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    result = ta.paged_decode_attention(query, k_cache, v_cache, tables.int(), lens, BLOCK_SIZE, scale, out=out,
                                       num_splits=splits)
    assert result is out and result.dtype == dtype
    assert not out.isnan().any(), "some output elements were never written"
    assert rel_err(out, reference(query, k_cache, v_cache, tables, lens, scale)) < tol


@interpreted_only
@pytest.mark.parametrize("window,softcap,splits", [(7, None, 1), (70, None, 3), (None, 2.0, 1), (40, 1.5, None)])
def test_sliding_window_and_softcap(window, softcap, splits):
    query, k_cache, v_cache, tables, lens = make_case(CONTEXTS, 2, 4, 64, torch.float32, seed=2)
    out = ta.paged_decode_attention(query, k_cache, v_cache, tables, lens, BLOCK_SIZE, 0.125, num_splits=splits,
                                    sliding_window=window, softcap=softcap)
    ref = reference(query, k_cache, v_cache, tables, lens, 0.125, window, softcap)
    assert rel_err(out, ref) < 1e-5


@interpreted_only
def test_strided_query_and_out_views():
    # A query view out of a packed [D, 3, H, Dh] qkv-like buffer, an `out` view into a wider
    # buffer, int64 tables and lengths.
    query, k_cache, v_cache, tables, lens = make_case([150, 1, 33], 2, 4, 64, torch.float32, seed=1)
    packed = torch.randn(query.shape[0], 3, *query.shape[1:])
    packed[:, 1] = query
    q_view = packed[:, 1]
    assert not q_view.is_contiguous()
    buf = torch.full((query.shape[0], query.shape[1], 96), float("nan"))
    out = buf[:, :, 16:80]
    ta.paged_decode_attention(q_view, k_cache, v_cache, tables.long(), lens.long(), BLOCK_SIZE, 0.125, out=out)
    ref = reference(query, k_cache, v_cache, tables, lens, 0.125)
    assert not out.isnan().any()
    assert buf[:, :, :16].isnan().all() and buf[:, :, 80:].isnan().all(), "wrote outside the out view"
    assert rel_err(out, ref) < 1e-5
    fresh = ta.paged_decode_attention(q_view, k_cache, v_cache, tables, lens, BLOCK_SIZE, 0.125)
    assert fresh.shape == query.shape and rel_err(fresh, ref) < 1e-5


def test_split_count_follows_the_batch():
    cpu = torch.device("cpu")  # counts as 132 SMs (an H100): about 264 programs wanted
    assert ta.default_num_splits(1, 8, cpu) == ta.MAX_SPLITS  # one sequence: split its context
    assert ta.default_num_splits(8, 8, cpu) == 4
    assert ta.default_num_splits(64, 8, cpu) == 1  # a full batch fills the GPU alone
    assert ta.default_num_splits(300, 1, cpu) == 1
