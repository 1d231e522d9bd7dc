"""Products with block-quantized weights on a CUDA device: one Triton kernel that widens
each weight tile in registers and multiplies it on the tensor cores (`tl.dot`).

The weights come from a PackedWeight (any format packed_weights.py reads: GGUF's Q4_0,
Q4_1, Q8_0, the K-quants and GPTQ/AWQ rewritten as Q4_F32/Q8_F32, FP8 as F8_F32) and are
laid out once for the device (`DeviceBlocks`): 4-bit quants two to a byte in column order
(byte j holds columns 2j and 2j+1), 8-bit integers or float8 e4m3 codes a byte each, and a
float32 scale and minimum per group of 32 columns (16 for Q8_F32, whose halves have their
own scales): w = s q + m (q an e4m3 code's value for FP8, m = 0), the same value the CPU
kernels widen to, rounded once to the activations' dtype (fp16/bf16, as the float copy
holds it; float32 stays exact). Decode reads 4.5-9 bits a weight instead of 16. (FP8 on a
GPU with FP8 tensor cores could multiply the codes as they are, `torch._scaled_mm`; that
path is not built.)

Triton is imported lazily, as in workers/model/triton_attention.py: without it this
module imports and `triton_available()` is False. Under `TRITON_INTERPRET=1` (set before
import) the kernel runs on CPU tensors through the interpreter, which is how the tests
check it; on a GPU it has not been run yet (issue "Real checkpoints": the GPU checklist).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.quant.k_quants import Q4_F32, Q8_F32
from workers.quant.packed_weights import (
    BLOCK_BYTES,
    BLOCK_WEIGHTS,
    F8_F32,
    PackedWeight,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the machine
    triton = None

FOUR_BIT = {2, 3, Q4_F32}  # Q4_0, Q4_1, Q4_F32
# How the kernel reads a weight's quants: 8-bit integers, 4-bit pairs, float8 e4m3 codes.
INT8, INT4, E4M3 = 0, 1, 2
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


def triton_available() -> bool:
    try:
        return triton is not None and torch.cuda.is_available()
    except Exception:
        return False


@dataclass(frozen=True)
class DeviceBlocks:
    """A weight [rows, cols] laid out for the kernel: quants (uint8 [rows, cols/2] for 4
    bits, int8 [rows, cols] for 8, uint8 e4m3 codes [rows, cols]), and float32 scales and
    minimums [rows, cols/group]; `kind` INT8, INT4 or E4M3."""
    quants: torch.Tensor
    scales: torch.Tensor
    minimums: torch.Tensor
    group: int
    kind: int

    @classmethod
    def of(cls, packed: PackedWeight, device: torch.device | str) -> "DeviceBlocks":
        rows, fmt = packed.rows, packed.fmt
        per_block = packed.blocks.view(rows, -1, BLOCK_BYTES[fmt])
        scales, minimums, quants = _fields_and_quants(fmt, per_block)
        group = BLOCK_WEIGHTS // scales.shape[-1]  # 16 when a block has two scales
        kind = INT4 if fmt in FOUR_BIT else E4M3 if fmt == F8_F32 else INT8
        if kind == INT4:
            q = torch.cat([quants & 0x0F, quants >> 4], dim=-1)  # the file's order: columns 0-15, 16-31
            q = q.reshape(rows, -1)
            quants = q[:, 0::2] | (q[:, 1::2] << 4)  # column order: byte j holds columns 2j and 2j+1
        else:
            quants = quants.reshape(rows, -1).view(torch.int8 if kind == INT8 else torch.uint8)
        return cls(quants.contiguous().to(device), scales.reshape(rows, -1).contiguous().to(device),
                   minimums.reshape(rows, -1).contiguous().to(device), group, kind)

    def dequantized(self) -> torch.Tensor:
        """The weight as float32 (tests)."""
        if self.kind == INT4:
            q = torch.stack([self.quants & 0x0F, self.quants >> 4], dim=-1).reshape(self.quants.shape[0], -1)
        elif self.kind == E4M3:
            q = self.quants.view(torch.float8_e4m3fn)
        else:
            q = self.quants
        rows = q.shape[0]
        grouped = q.float().view(rows, -1, self.group)
        return (grouped * self.scales.unsqueeze(-1) + self.minimums.unsqueeze(-1)).reshape(rows, -1)


def _fields_and_quants(fmt: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scales [rows, blocks, 1 or 2], minimums likewise, quant bytes [rows, blocks, n]) of
    row-layout blocks."""
    def half(start: int) -> torch.Tensor:
        return blocks[..., start:start + 2].contiguous().view(torch.float16).float()

    def single(start: int) -> torch.Tensor:
        return blocks[..., start:start + 4].contiguous().view(torch.float32)

    if fmt == Q4_F32:
        return single(0), single(4), blocks[..., 8:]
    if fmt == Q8_F32:
        scales = torch.cat([single(0), single(4)], dim=-1)
        return scales, single(8).expand_as(scales), blocks[..., 12:]
    if fmt == F8_F32:
        return single(0), torch.zeros_like(single(0)), blocks[..., 4:]
    d = half(0)
    if fmt == 3:  # Q4_1
        return d, half(2), blocks[..., 4:]
    if fmt == 2:  # Q4_0: w = d (q - 8)
        return d, -8.0 * d, blocks[..., 2:]
    return d, torch.zeros_like(d), blocks[..., 2:]  # Q8_0


def dequantized_matmul(x: torch.Tensor, weight: DeviceBlocks) -> torch.Tensor:
    """x [M, K] (contiguous, fp16/bf16/float32) times the transpose of the weight [N, K]."""
    M, K = x.shape
    N = weight.scales.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))
    _dequantized_matmul_kernel[grid](
        x, weight.quants, weight.scales, weight.minimums, y, M, N, K,
        GROUP=weight.group, KIND=weight.kind, IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


if triton is not None:

    # Grid (M tiles, N tiles): each program walks K in tiles of BLOCK_K columns, loads the
    # weight tile's quants, scales and minimums, widens it to the activations' dtype in
    # registers and accumulates tl.dot in float32.
    @triton.jit
    def _dequantized_matmul_kernel(
        x_ptr, q_ptr, s_ptr, m_ptr, y_ptr, M, N, K,
        GROUP: tl.constexpr, KIND: tl.constexpr, IEEE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        groups = K // GROUP
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
            if KIND == 1:  # INT4
                rb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                packed = tl.load(q_ptr + rn[:, None] * (K // 2) + rb[None, :],
                                 mask=(rn[:, None] < N) & (rb[None, :] < K // 2), other=0)
                q = tl.join(packed & 15, packed >> 4).reshape(BLOCK_N, BLOCK_K).to(tl.float32)
            else:
                q = tl.load(q_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K),
                            other=0)
                if KIND == 2:  # E4M3: the code's fields moved into fp16's (cpu_kernels.c e4m3_half_bits)
                    e = q.to(tl.uint16)
                    q = (((e & 0x80) << 8) | ((e & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
                else:
                    q = q.to(tl.float32)
            rg = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
            fields = rn[:, None] * groups + rg[None, :]
            present = (rn[:, None] < N) & (rg[None, :] < groups)
            s = tl.load(s_ptr + fields, mask=present, other=0.0)
            m = tl.load(m_ptr + fields, mask=present, other=0.0)
            w = q.reshape(BLOCK_N, BLOCK_K // GROUP, GROUP) * s[:, :, None] + m[:, :, None]
            w = w.reshape(BLOCK_N, BLOCK_K).to(x.dtype)
            if IEEE:
                acc += tl.dot(x, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w))
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))
