"""The C kernels of cpu_kernels.c, built once per machine with the host's C compiler
(workers/native/build.py) and called through ctypes. Without a C compiler `kernels()` is
None and the models load as floats (workers/model/gguf_packing.py says so in the log).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path

import torch

from workers.native.build import load_library

SOURCE = Path(__file__).with_name("cpu_kernels.c")
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_GATE = 0, 1, 2  # cpu_kernels.c's prologues


class QuantKernels:
    """Typed wrappers over the loaded library; tensors in, tensors out."""

    def __init__(self, library: ctypes.CDLL):
        self._matmul = library.quantized_matmul
        self._matmul.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self._interleaved = library.interleaved_matmul
        self._interleaved.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                      ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                      ctypes.c_int]
        self._fused = library.fused_interleaved_matmul
        self._fused.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_float, ctypes.c_int]
        self._work_bytes = library.interleaved_matmul_work_bytes
        self._work_bytes.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        self._work_bytes.restype = ctypes.c_int64
        self._dequantize_interleaved = library.dequantize_interleaved_rows
        self._dequantize_interleaved.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                 ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
        self._dequantize = library.dequantize_rows
        self._dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]

    def __deepcopy__(self, memo: dict) -> "QuantKernels":
        return self  # one loaded library a process; a copied model shares it

    def __reduce__(self):
        return (_loaded_kernels, ())  # a pickled model finds (or builds) the library where it lands

    def matmul(self, fmt: int, blocks: torch.Tensor, cols: int, x: torch.Tensor) -> torch.Tensor:
        """x (M x cols, float32, contiguous) times the transpose of the block rows, in
        float32 (the dequantized product up to summation order)."""
        out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
        status = self._matmul(fmt, blocks.data_ptr(), blocks.shape[0], cols, x.data_ptr(), x.shape[0],
                              out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"quantized_matmul: format {fmt} with {cols} columns is not supported")
        return out

    def interleaved_matmul(self, fmt: int, interleaved: torch.Tensor, rows: int, cols: int, x: torch.Tensor,
                           levels: int = 1) -> torch.Tensor:
        """x (M x cols, float32, contiguous), rounded to 8 bits a block, times the transpose
        of `rows` weight rows laid out by packed_weights.interleave_rows. One level: the
        activations' rounding (relative error ~0.5 %, llama.cpp's); two (x rounded, then
        what that left out): ~1e-4, for about twice the integer work."""
        out = torch.empty(x.shape[0], rows, dtype=torch.float32)
        work = self.work_buffer(x.shape[0], cols, levels)
        status = self._interleaved(fmt, interleaved.data_ptr(), rows, cols, x.data_ptr(), x.shape[0],
                                   out.data_ptr(), work.data_ptr(), levels, torch.get_num_threads())
        if status:
            raise ValueError(f"interleaved_matmul: format {fmt} with {rows} x {cols}, {levels} levels, "
                             "is not supported")
        return out

    def fused_interleaved_matmul(self, fmt: int, interleaved: torch.Tensor, cols: int, x: torch.Tensor,
                                 out: torch.Tensor, levels: int, prologue: int, norm_weight: torch.Tensor | None = None,
                                 eps: float = 0.0, accumulate: bool = False) -> torch.Tensor:
        """interleaved_matmul into `out` (M x rows, float32, contiguous) with a PROLOGUE_* on
        each row of x (rows x.stride(0) floats apart, unit stride within; a SILU_GATE row
        holds gate then up, 2 x cols) and, with `accumulate`, out += the product."""
        rows = x.shape[0]
        work = self.work_buffer(rows, cols, levels)
        status = self._fused(fmt, interleaved.data_ptr(), out.shape[1], cols, x.data_ptr(), x.stride(0), rows,
                             out.data_ptr(), work.data_ptr(), levels, torch.get_num_threads(), prologue,
                             None if norm_weight is None else norm_weight.data_ptr(), eps, int(accumulate))
        if status:
            raise ValueError(f"fused_interleaved_matmul: format {fmt} with {out.shape[1]} x {cols}, {levels} levels, "
                             f"prologue {prologue}, is not supported")
        return out

    def work_buffer(self, rows: int, cols: int, levels: int) -> torch.Tensor:
        """This thread's scratch for an interleaved product of `rows` x `cols` activations
        (reused across calls, grown as needed)."""
        return _work_buffer(self._work_bytes(rows, cols, levels))

    def dequantize_interleaved(self, fmt: int, interleaved: torch.Tensor, cols: int, rows: torch.Tensor,
                               out: torch.Tensor) -> torch.Tensor:
        """Rows `rows` (int64 ids) of a weight laid out by packed_weights.interleave_rows,
        as float32 into `out`."""
        status = self._dequantize_interleaved(fmt, interleaved.data_ptr(), cols, rows.data_ptr(), rows.numel(),
                                              out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"dequantize_interleaved_rows: format {fmt} with {cols} columns is not supported")
        return out

    def dequantize(self, fmt: int, blocks: torch.Tensor, cols: int, out: torch.Tensor,
                   rows: torch.Tensor | None = None, first: int = 0) -> torch.Tensor:
        """Rows `rows` (int64 ids), or out.shape[0] rows from `first`, as float32 into `out`."""
        count = out.shape[0] if rows is None else rows.numel()
        status = self._dequantize(fmt, blocks.data_ptr(), cols, None if rows is None else rows.data_ptr(),
                                  first, count, out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"dequantize_rows: format {fmt} with {cols} columns is not supported")
        return out


_work = threading.local()  # one scratch buffer a thread, grown as needed: no allocation a call


def _work_buffer(size: int) -> torch.Tensor:
    buffer = getattr(_work, "buffer", None)
    if buffer is None or buffer.numel() < size:
        buffer = _work.buffer = torch.empty(max(size, 1 << 16), dtype=torch.uint8)
    return buffer


@functools.cache
def kernels() -> QuantKernels | None:
    """The kernels for this machine, built at the first call; None without a C compiler
    or when the build fails (logged)."""
    library = load_library(SOURCE, "quantized weights load as floats")
    return None if library is None else QuantKernels(library)


def _loaded_kernels() -> QuantKernels:
    loaded = kernels()
    if loaded is None:
        raise RuntimeError("a model with quantized layers needs the C kernels, which could not be built here")
    return loaded
