"""Decode attention on the CPU by cpu_attention.c: each decode row's query over its context
read in place from the paged cache (no gather of whole blocks, no padding mask, one call a
layer), in a fixed order per sequence whatever the batch. None where the C source cannot be
built: decode rows then take SDPA over a gather (attention.py)."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from workers.native.build import load_library

SOURCE = Path(__file__).with_name("cpu_attention.c")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # cpu_attention.c's DT_*


class CpuDecodeAttention:
    """The kernel over tensors; `__call__` says whether it ran."""

    def __init__(self, library: ctypes.CDLL):
        self._attend = library.paged_decode_attention
        self._attend.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int64,
                                 ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
        self._attend.restype = ctypes.c_int
        self._rotate = library.rotate_and_cache
        self._rotate.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_void_p, ctypes.c_int]
        self._rotate.restype = ctypes.c_int

    def rotate_and_cache(self, qkv: torch.Tensor, heads: int, kv_heads: int, cos: torch.Tensor,
                         signed_sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor) -> bool:
        """qkv [T, heads + 2 kv_heads, Dh] float32: q and k heads rotated in place (the same
        bits as torch's x * cos + x.roll(Dh / 2) * signed_sin), then each token's k and v
        written to its cache slot. cos / signed_sin hold T rows of Dh. False (nothing done)
        for a layout or dtype the kernel does not take, or a slot outside the caches."""
        tensors = (qkv, cos, signed_sin, k_cache, v_cache)
        if (any(t.dtype != torch.float32 or not t.is_contiguous() for t in tensors)
                or slots.dtype != torch.int64 or not slots.is_contiguous() or k_cache.shape != v_cache.shape):
            return False
        status = self._rotate(qkv.data_ptr(), qkv.shape[0], heads, kv_heads, qkv.shape[2], cos.data_ptr(),
                              signed_sin.data_ptr(), slots.data_ptr(), k_cache.shape[0], k_cache.data_ptr(),
                              v_cache.data_ptr(), torch.get_num_threads())
        return status == 0

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor, block_size: int, scale: float, window: int | None, softcap: float | None,
                 out: torch.Tensor) -> bool:
        """q [D, H, Dh] (rows may be strided), caches [slots, KVH, Dh], tables [D, W] int64,
        lens [D] int32 -> out [D, H, Dh] contiguous. False (nothing written) for a layout or
        dtype the kernel does not take."""
        code = DTYPE_CODES.get(q.dtype)
        num_seqs, heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # transformers' hook hands q head-major
        if (code is None or not out.is_contiguous()
                or not k_cache.is_contiguous() or not v_cache.is_contiguous()
                or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype or out.dtype != q.dtype
                or tables.dtype != torch.int64 or lens.dtype != torch.int32):
            return False
        tables, lens = tables.contiguous(), lens.contiguous()
        status = self._attend(code, q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), heads,
                              k_cache.shape[1], head_dim, block_size, tables.data_ptr(), tables.shape[1],
                              lens.data_ptr(), num_seqs, scale, window or 0, softcap or 0.0, out.data_ptr(),
                              torch.get_num_threads())
        return status == 0


@functools.cache
def cpu_decode_attention() -> CpuDecodeAttention | None:
    """The kernel for this machine, built at the first call; None without a C compiler."""
    library = load_library(SOURCE, "CPU decode rows take SDPA over a gather")
    return None if library is None else CpuDecodeAttention(library)
