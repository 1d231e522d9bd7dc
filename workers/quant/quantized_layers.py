"""Linear and embedding layers whose weight stays in quantized blocks (packed_weights.py).

A linear layer picks its product by the number of input rows, as measured on one pass
over the default model's 212 matrices (2-core AMD EPYC Zen 3, AVX2, float32; against the
float model's oneDNN-packed product, 2026-11-26):
- one row (a decode step of one sequence), unless the model's config says
  `quantized_matvec: float32`: the activations are rounded to 8 bits a block and
  multiplied as integers (cpu_kernels.c, llama.cpp's way): 6.3 ms, against 11.8 ms
  widening the weights to float and ~27 ms for the float model (the output head is left
  exact, workers/model/gguf_packing.py says why);
- up to KERNEL_MAX_ROWS rows: each weight block is widened to float32 in registers and
  multiplied with float32 activations (the dequantized product up to summation order):
  14 / 28 / 58 ms at 2 / 8 / 16 rows against 37 / 47 / 62 ms;
- more rows (prefill, large batches): the weight is dequantized a slice at a time into a
  reused buffer for torch's float matmul: 101 / 160 / 521 ms at 32 / 64 / 256 rows against
  101 / 155 / 525 ms alone, but slower inside a running engine, where MKL re-packs each
  fresh slice and the float model's GEMM was packed once (docs/BENCHMARKS.md). A blocked
  kernel of our own did not beat the slices (4x2 tiles: 229 against 187 ms at 64 rows).
So the numbers of a sequence alone in a step differ from those it gets beside others in
the last bits (as they already do between batch shapes). The result comes back in the
input's dtype.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from workers.quant.native_kernels import QuantKernels
from workers.quant.packed_weights import PackedWeight

KERNEL_MAX_ROWS = 16
SCRATCH_FLOATS = 1 << 20  # 4 MiB: a slice of dequantized weight stays in the CPU's caches

_scratch = threading.local()  # one buffer a thread: steps on different threads never share one


def _scratch_buffer() -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = torch.empty(SCRATCH_FLOATS, dtype=torch.float32)
    return buffer


class QuantizedLinear(nn.Module):
    """Stands where an `nn.Linear` stood. `weight` is a meta tensor of the float shape and
    dtype, for code that reads a layer's shape (the engine reads the vocabulary size off
    the output embedding); computing with it fails loudly."""

    def __init__(self, packed: PackedWeight, kernels: QuantKernels, bias: torch.Tensor | None, dtype: torch.dtype,
                 int8_single_row: bool = True):
        super().__init__()
        self.fmt, self.format_name, self.kernels = packed.fmt, packed.format_name, kernels
        self.int8_single_row = int8_single_row  # one-row products with 8-bit activations
        self.in_features, self.out_features = packed.cols, packed.rows
        self.register_buffer("blocks", packed.blocks)  # counted and moved with the model's buffers
        self.bias = bias
        self.weight = torch.empty(packed.rows, packed.cols, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.float32).contiguous()
        if flat.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernels.matmul(self.fmt, self.blocks, self.in_features, flat,
                                      int8_activations=self.int8_single_row and flat.shape[0] == 1)
        else:
            out = self._dequantized_matmul(flat)
        if self.bias is not None:
            out += self.bias
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def _dequantized_matmul(self, flat: torch.Tensor) -> torch.Tensor:
        # Computed transposed (weight slice times flat's transpose) so each slice's product
        # lands in contiguous rows of one buffer; one transpose at the end. Also faster:
        # `flat @ weight.t()` on a whole layer (8 MiB buffer) made the engine's 32-row decode
        # steps 1.4x slower (TPOT 228 against 162 ms, 2026-11-26, EPYC).
        out_t = torch.empty(self.out_features, flat.shape[0], dtype=torch.float32)
        scratch = _scratch_buffer()
        step = max(1, SCRATCH_FLOATS // self.in_features)
        for first in range(0, self.out_features, step):
            count = min(step, self.out_features - first)
            weight = scratch[: count * self.in_features].view(count, self.in_features)
            self.kernels.dequantize(self.fmt, self.blocks, self.in_features, weight, first=first)
            torch.mm(weight, flat.t(), out=out_t[first:first + count])
        return out_t.t().contiguous()

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 (tests, and checking a layer against its float twin)."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        return self.kernels.dequantize(self.fmt, self.blocks, self.in_features, out)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format_name}, bias={self.bias is not None}")


class QuantizedEmbedding(nn.Module):
    """Stands where an `nn.Embedding` stood: the looked-up rows are dequantized. A tied
    output layer shares the same blocks (one copy)."""

    def __init__(self, packed: PackedWeight, kernels: QuantKernels, dtype: torch.dtype):
        super().__init__()
        self.fmt, self.format_name, self.kernels, self.dtype = packed.fmt, packed.format_name, kernels, dtype
        self.num_embeddings, self.embedding_dim = packed.rows, packed.cols
        self.register_buffer("blocks", packed.blocks)
        self.weight = torch.empty(packed.rows, packed.cols, dtype=dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lowest, highest = torch.aminmax(flat) if flat.numel() else (0, 0)
        if int(lowest) < 0 or int(highest) >= self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")  # the C loop does not check
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        self.kernels.dequantize(self.fmt, self.blocks, self.embedding_dim, out, rows=flat)
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format_name}"
