"""A weight matrix held in GGUF's quantized blocks, and reading those from a GGUF file.

Each row (one output feature) is a run of blocks of 32 weights along the input dimension,
so selecting or stacking rows (the q/k head order, fused q/k/v) moves whole byte rows and
never touches a block. The bytes are the file's own: memory-mapped by the reader, copied
once into the process so the file can change under a running replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from workers.quant.k_quants import CONVERTED_FORMAT, Q4_F32, Q8_F32, convert_k_quant

F8_F32 = 130  # cpu_kernels.c's block of an FP8 checkpoint: float32 scale, 32 float8 e4m3 codes
# format id -> bytes per block of 32 weights: the formats cpu_kernels.c multiplies (ggml's
# type ids, k_quants.py's float-field blocks holding the K-quants, fp8_blocks.py's).
BLOCK_BYTES = {2: 18, 3: 20, 8: 34, Q4_F32: 24, Q8_F32: 44, F8_F32: 36}
FORMAT_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0", Q4_F32: "Q4_F32", Q8_F32: "Q8_F32", F8_F32: "F8_E4M3"}
INTEGER_FORMATS = {2, 3, 8, Q4_F32, Q8_F32}  # quants the 8-bit GEMM multiplies as integers
BLOCK_WEIGHTS = 32
GROUP_ROWS = 8  # rows interleaved together for the 8-bit GEMM (cpu_kernels.c)
# the fields ahead of each block's quants: (bytes of one, how many): fp16 scale (and Q4_1's
# minimum); float32 scale(s) and minimum
FIELDS = {2: (2, 1), 3: (2, 2), 8: (2, 1), Q4_F32: (4, 2), Q8_F32: (4, 3), F8_F32: (4, 1)}
RUN_BYTES = 4  # a row's bytes in each 32-byte run of an interleaved block


@dataclass(frozen=True)
class PackedWeight:
    fmt: int  # ggml type id (BLOCK_BYTES)
    blocks: torch.Tensor  # uint8, rows x (cols / 32 * BLOCK_BYTES[fmt])
    cols: int  # input features

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    def select_rows(self, order: torch.Tensor) -> "PackedWeight":
        return PackedWeight(self.fmt, self.blocks[order].contiguous(), self.cols)

    def narrow(self, dim: int, start: int, end: int) -> "PackedWeight | None":
        """Rows (dim 0) or input columns (dim 1) start..end-1, as a tensor-parallel shard
        holds them; None when columns do not fall on whole blocks."""
        if dim == 0:
            return PackedWeight(self.fmt, self.blocks[start:end].contiguous(), self.cols)
        if start % BLOCK_WEIGHTS or end % BLOCK_WEIGHTS:
            return None
        per_block = self.blocks.view(self.rows, -1, BLOCK_BYTES[self.fmt])
        kept = per_block[:, start // BLOCK_WEIGHTS:end // BLOCK_WEIGHTS]
        return PackedWeight(self.fmt, kept.reshape(self.rows, -1).contiguous(), end - start)

    @staticmethod
    def stacked(parts: list["PackedWeight"]) -> "PackedWeight":
        """The parts' rows one after another (they share a format and a width)."""
        first = parts[0]
        if any(part.fmt != first.fmt or part.cols != first.cols for part in parts):
            raise ValueError("stacked weights must share a format and an input width")
        return PackedWeight(first.fmt, torch.cat([part.blocks for part in parts]), first.cols)


def interleave_rows(blocks: torch.Tensor, fmt: int) -> torch.Tensor:
    """The rows of `blocks` (row layout, rows a multiple of GROUP_ROWS) in the layout of
    cpu_kernels.c's `interleaved_matmul`: per group of 8 rows and block of 32 columns, the 8
    rows' scales, then (Q4_1) their minimums, then runs of 32 quant bytes holding 4 bytes of
    each row. The same bytes, moved: a 1-byte-a-weight permutation, so it costs no memory."""
    rows, width = blocks.shape
    nblocks, block = width // BLOCK_BYTES[fmt], BLOCK_BYTES[fmt]
    size, count = FIELDS[fmt]
    grouped = blocks.view(rows // GROUP_ROWS, GROUP_ROWS, nblocks, block)
    parts = [grouped[..., start:start + size].transpose(1, 2).reshape(rows // GROUP_ROWS, nblocks, size * GROUP_ROWS)
             for start in range(0, size * count, size)]
    quants = grouped[..., size * count:]
    runs = quants.reshape(*quants.shape[:3], -1, RUN_BYTES)  # (group, row, block, run, 4 bytes)
    parts.append(runs.permute(0, 2, 3, 1, 4).reshape(rows // GROUP_ROWS, nblocks, -1))
    return torch.cat(parts, dim=2).reshape(rows // GROUP_ROWS, -1).contiguous()


def deinterleave_rows(interleaved: torch.Tensor, fmt: int, cols: int) -> torch.Tensor:
    """The inverse of `interleave_rows`: the row layout back."""
    groups, block, nblocks = interleaved.shape[0], BLOCK_BYTES[fmt], cols // BLOCK_WEIGHTS
    per_block = interleaved.view(groups, nblocks, GROUP_ROWS * block)
    size, count = FIELDS[fmt]
    parts = [per_block[..., GROUP_ROWS * start:GROUP_ROWS * (start + size)].reshape(groups, nblocks, GROUP_ROWS, size)
             .transpose(1, 2) for start in range(0, size * count, size)]
    runs = per_block[..., GROUP_ROWS * size * count:].reshape(groups, nblocks, -1, GROUP_ROWS, RUN_BYTES)
    parts.append(runs.permute(0, 3, 1, 2, 4).reshape(groups, GROUP_ROWS, nblocks, -1))
    return torch.cat(parts, dim=3).reshape(groups * GROUP_ROWS, nblocks * block).contiguous()


def read_gguf_weights(path: Path) -> dict[str, PackedWeight]:
    """The file's 2-D tensors in a format the kernels take, by GGUF name (blk.0.attn_q.weight,
    token_embd.weight, ...): Q4_0, Q4_1 and Q8_0 as they are, Q4_K, Q5_K and Q6_K rewritten
    (k_quants.py); the others (F32 norms, F16, other quantizations) are left to the float
    model."""
    import gguf  # the reader; imported here as only GGUF sources need it

    weights = {}
    for tensor in gguf.GGUFReader(path).tensors:
        fmt = int(tensor.tensor_type)
        if (fmt not in BLOCK_BYTES and fmt not in CONVERTED_FORMAT) or len(tensor.shape) != 2:
            continue
        cols, rows = (int(size) for size in tensor.shape)  # GGUF lists the fastest dimension first
        if cols % BLOCK_WEIGHTS:
            continue
        data = np.ascontiguousarray(tensor.data, dtype=np.uint8).reshape(rows, -1)
        if fmt in CONVERTED_FORMAT:
            fmt, data = convert_k_quant(fmt, data)
        weights[tensor.name] = PackedWeight(fmt, torch.from_numpy(data.copy()), cols)
    return weights
