"""Linear and embedding layers whose weight stays in quantized blocks (packed_weights.py).

A linear layer computes in one of three ways, chosen by the model's config
(`quantized_activations`), as measured on one pass over the default model's 210
non-head matrices at 1 / 16 / 32 / 64 / 256 rows (2-core AMD EPYC Zen 3, AVX2, float32,
2026-11-26, one run; the float model's oneDNN-packed product: 30.2 / 47.3 / 69.8 / 124.8 /
371 ms):
- `int8x2` (the default) and `int8`: the weight rows are interleaved by 8 and the
  activations rounded to 8 bits a block, multiplied as integers (cpu_kernels.c
  `interleaved_matmul`, llama.cpp's way). `int8` rounds once (~0.5 % relative error,
  llama.cpp's numbers): 5.3 / 15.1 / 31.7 / 56.2 / 192 ms. `int8x2` also multiplies what
  the rounding left out, rounded again (~2e-5, float-like: the default model's greedy text
  stays the float copy's where one rounding changes its first answer): 5.4 / 26.6 / 60.8 /
  100.6 / 376 ms. A row's result does not depend on the other rows of the step.
- `float32`: each block widened to float32 for up to KERNEL_MAX_ROWS rows; beyond,
  the weight dequantized a slice at a time into a reused buffer for torch's float matmul:
  15.6 / 39.9 / 90.2 / 123.9 / 436 ms, the dequantized float product up to summation order.
The output head never takes one rounding (int8x2 under int8: workers/model/packed_swap.py
says why); a tied embedding reads its rows from the head's interleaved blocks. The result
comes back in the input's dtype. `fused` is the 8-bit product with a layer's RMSNorm or
SiLU gate done on each row first, and its residual add (the direct forward's fused layers).
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from workers.quant.native_kernels import PROLOGUE_NONE, QuantKernels
from workers.quant.packed_weights import (
    GROUP_ROWS,
    INTEGER_FORMATS,
    PackedWeight,
    deinterleave_rows,
    interleave_rows,
)
from workers.quant.triton_matmul import DeviceBlocks, dequantized_matmul

KERNEL_MAX_ROWS = 16
ACTIVATION_LEVELS = {"int8": 1, "int8x2": 2}  # quantized_activations -> levels of 8-bit rounding; float32: none
SCRATCH_FLOATS = 1 << 20  # 4 MiB: a slice of dequantized weight stays in the CPU's caches

_scratch = threading.local()  # one buffer a thread: steps on different threads never share one


def natural_columns(weight: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
    """A weight whose columns are the inputs in `input_order`, with its columns put back in
    the inputs' own order (None: already so)."""
    if input_order is None:
        return weight
    natural = torch.empty_like(weight)
    natural[:, input_order] = weight
    return natural


def _scratch_buffer() -> torch.Tensor:
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = torch.empty(SCRATCH_FLOATS, dtype=torch.float32)
    return buffer


class QuantizedLinear(nn.Module):
    """Stands where an `nn.Linear` stood. `weight` is a meta tensor of the float shape and
    dtype, for code that reads a layer's shape (the engine reads the vocabulary size off
    the output embedding); computing with it fails loudly. `input_order`: the input
    columns the packed rows hold, in order (a GPTQ act-order checkpoint's groups made
    contiguous); the input is gathered into that order first."""

    def __init__(self, packed: PackedWeight, kernels: QuantKernels, bias: torch.Tensor | None, dtype: torch.dtype,
                 activations: str = "int8x2", input_order: torch.Tensor | None = None):
        super().__init__()
        self.fmt, self.format_name, self.kernels = packed.fmt, packed.format_name, kernels
        if packed.fmt not in INTEGER_FORMATS:
            activations = "float32"  # FP8 codes are not integers: the float products only
        self.activations = activations
        self.levels = ACTIVATION_LEVELS.get(activations, 0)  # 0: float32 activations, the file's rows
        self.in_features, self.out_features = packed.cols, packed.rows
        blocks = packed.blocks
        if self.levels:  # zero rows up to whole groups of 8 (their outputs are dropped)
            padding = blocks.new_zeros(-packed.rows % GROUP_ROWS, blocks.shape[1])
            blocks = interleave_rows(torch.cat([blocks, padding]), packed.fmt)
        self.register_buffer("blocks", blocks)  # counted and moved with the model's buffers
        self.register_buffer("input_order", input_order)
        self.reordered = input_order is not None  # a plain attribute: a buffer's lookup costs on every call
        self.bias = bias
        self.weight = torch.empty(packed.rows, packed.cols, dtype=dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32 or not flat.is_contiguous():  # (checked: a no-op call costs per layer)
            flat = flat.to(torch.float32).contiguous()
        if self.reordered:
            flat = flat.index_select(1, self.input_order)
        if self.levels:
            out = self.kernels.interleaved_matmul(self.fmt, self.blocks, self.blocks.shape[0] * GROUP_ROWS,
                                                  self.in_features, flat, self.levels)
            if out.shape[1] != self.out_features:
                out = out[:, :self.out_features].contiguous()
        elif flat.shape[0] <= KERNEL_MAX_ROWS:
            out = self.kernels.matmul(self.fmt, self.blocks, self.in_features, flat)
        else:
            out = self._dequantized_matmul(flat)
        if self.bias is not None:
            out += self.bias
        if x.dtype != torch.float32:
            out = out.to(x.dtype)
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features)

    def fusable(self, accumulate: bool = False) -> bool:
        """Whether `fused` computes this layer: 8-bit activations, whole groups of 8 output
        rows, inputs in their own order, and no bias where the product is added in place."""
        return (bool(self.levels) and not self.reordered and self.out_features % GROUP_ROWS == 0
                and not (accumulate and self.bias is not None))

    def fused(self, x: torch.Tensor, prologue: int = PROLOGUE_NONE, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The product of x's float32 rows after a prologue (cpu_kernels.c: PROLOGUE_RMS_NORM
        by `norm_weight`, or PROLOGUE_SILU_GATE on rows holding gate then up): a new [M, out]
        tensor, or added in place into `residual` [M, out] and that returned. Only where
        `fusable` says so."""
        out = residual if residual is not None else torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.kernels.fused_interleaved_matmul(self.fmt, self.blocks, self.in_features, x, out, self.levels, prologue,
                                              norm_weight, eps, accumulate=residual is not None)
        if self.bias is not None:
            out += self.bias
        return out

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

    def row_blocks(self) -> torch.Tensor:
        """The weight's blocks in the file's layout, a row of blocks per output feature."""
        if not self.levels:
            return self.blocks
        return deinterleave_rows(self.blocks, self.fmt, self.in_features)[:self.out_features]

    def dequantized(self) -> torch.Tensor:
        """The whole weight as float32 (tests, and checking a layer against its float twin)."""
        out = torch.empty(self.out_features, self.in_features, dtype=torch.float32)
        self.kernels.dequantize(self.fmt, self.row_blocks().contiguous(), self.in_features, out)
        return natural_columns(out, self.input_order)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"format={self.format_name}, activations={self.activations}, bias={self.bias is not None}")


class QuantizedEmbedding(nn.Module):
    """Stands where an `nn.Embedding` stood: the looked-up rows are dequantized. A tied
    output layer shares the same blocks (one copy): `tied_head`, a QuantizedLinear holding
    them interleaved, whose blocks the rows are then read from."""

    def __init__(self, packed: PackedWeight, kernels: QuantKernels, dtype: torch.dtype,
                 tied_head: QuantizedLinear | None = None):
        super().__init__()
        self.fmt, self.format_name, self.kernels, self.dtype = packed.fmt, packed.format_name, kernels, dtype
        self.num_embeddings, self.embedding_dim = packed.rows, packed.cols
        self.interleaved = tied_head is not None and bool(tied_head.levels)
        self.register_buffer("blocks", tied_head.blocks if tied_head is not None else packed.blocks)
        self.weight = torch.empty(packed.rows, packed.cols, dtype=dtype, device="meta")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        lowest, highest = torch.aminmax(flat) if flat.numel() else (0, 0)
        if int(lowest) < 0 or int(highest) >= self.num_embeddings:
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")  # the C loop does not check
        out = torch.empty(flat.numel(), self.embedding_dim, dtype=torch.float32)
        if self.interleaved:
            self.kernels.dequantize_interleaved(self.fmt, self.blocks, self.embedding_dim, flat, out)
        else:
            self.kernels.dequantize(self.fmt, self.blocks, self.embedding_dim, out, rows=flat)
        return out.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.format_name}"


class DeviceQuantizedLinear(nn.Module):
    """Stands where an `nn.Linear` stood on a CUDA device: the weight as DeviceBlocks
    (4- or 8-bit quants, float32 scales and minimums, as buffers that move with the
    model), multiplied by triton_matmul's kernel in the activations' dtype. `weight` and
    `input_order` as in QuantizedLinear."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 input_order: torch.Tensor | None = None):
        super().__init__()
        blocks = DeviceBlocks.of(packed, "cpu")  # moved with the model
        self.format_name, self.group, self.kind = packed.format_name, blocks.group, blocks.kind
        self.in_features, self.out_features = packed.cols, packed.rows
        self.register_buffer("quants", blocks.quants)
        self.register_buffer("scales", blocks.scales)
        self.register_buffer("minimums", blocks.minimums)
        self.register_buffer("input_order", input_order)
        self.reordered = input_order is not None
        self.bias = bias
        self.weight = torch.empty(packed.rows, packed.cols, dtype=dtype, device="meta")

    def device_blocks(self) -> DeviceBlocks:
        return DeviceBlocks(self.quants, self.scales, self.minimums, self.group, self.kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.reordered:
            flat = flat.index_select(1, self.input_order)
        out = dequantized_matmul(flat.contiguous(), self.device_blocks())
        if self.bias is not None:
            out += self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        return natural_columns(self.device_blocks().dequantized(), self.input_order)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format_name}"
