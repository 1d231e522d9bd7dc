"""An FP8 checkpoint's weights rewritten, exactly, as blocks the kernels take.

The FP8 checkpoints of Llama, Qwen and DeepSeek hold each linear's weight as float8 e4m3
codes e [out, in] and a float32 (or bf16) scale per tensor, per output row, or per block
of B0 x B1 weights (DeepSeek's 128 x 128 `weight_scale_inv`, edge blocks partial):
W = s e. When B1 is a multiple of 32, each run of 32 inputs of a row shares one scale, so
the row is a run of F8_F32 blocks (cpu_kernels.c: a float32 scale and the 32 codes as
they are; 9 bits a weight): the kernels widen them to the very floats torch's
`codes.float() * scale` gives. The codes are not integers, so these layers take the
float products only (quantized_layers.py).
"""

from __future__ import annotations

import torch

from workers.quant.packed_weights import BLOCK_WEIGHTS, F8_F32, PackedWeight


def fp8_blocks(codes: torch.Tensor, scale: torch.Tensor,
               block_size: tuple[int, int] | list[int] | None = None) -> PackedWeight | None:
    """F8_F32 blocks of an e4m3 weight [out, in] with its `scale` (per tensor, per row, or
    per block of `block_size` when given); None for what the blocks cannot hold exactly:
    another float8 kind, inputs not a multiple of 32, scale blocks narrower than 32 or
    not a multiple of it, or a scale of another shape."""
    if codes.dtype != torch.float8_e4m3fn or codes.dim() != 2 or codes.shape[1] % BLOCK_WEIGHTS:
        return None
    rows, cols = codes.shape
    per_block = _scale_per_block(scale.float(), rows, cols, block_size)
    if per_block is None:
        return None
    fields = per_block.contiguous().view(torch.uint8).view(rows, -1, 4)  # [rows, blocks, 4]
    quants = codes.contiguous().view(torch.uint8).view(rows, -1, BLOCK_WEIGHTS)
    blocks = torch.cat([fields, quants], dim=-1).reshape(rows, -1).contiguous()
    return PackedWeight(F8_F32, blocks, cols)


def _scale_per_block(scale: torch.Tensor, rows: int, cols: int,
                     block_size: tuple[int, int] | list[int] | None) -> torch.Tensor | None:
    """The scale of each block of 32 inputs of each row [rows, cols / 32], or None."""
    blocks = cols // BLOCK_WEIGHTS
    if block_size is not None:
        block_rows, block_cols = (int(size) for size in block_size)
        if block_cols % BLOCK_WEIGHTS or tuple(scale.shape) != (-(-rows // block_rows), -(-cols // block_cols)):
            return None
        column = torch.arange(blocks) * BLOCK_WEIGHTS // block_cols  # the scale block of each 32 inputs
        return scale.repeat_interleave(block_rows, 0)[:rows][:, column]
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, blocks)
    if scale.numel() == rows:
        return scale.reshape(rows, 1).expand(rows, blocks)
    return None
