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

# ggml type id -> bytes per block of 32 weights: the formats cpu_kernels.c multiplies.
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0
FORMAT_NAMES = {2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
BLOCK_WEIGHTS = 32


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

    @staticmethod
    def stacked(parts: list["PackedWeight"]) -> "PackedWeight":
        """The parts' rows one after another (they share a format and a width)."""
        first = parts[0]
        if any(part.fmt != first.fmt or part.cols != first.cols for part in parts):
            raise ValueError("stacked weights must share a format and an input width")
        return PackedWeight(first.fmt, torch.cat([part.blocks for part in parts]), first.cols)


def read_gguf_weights(path: Path) -> dict[str, PackedWeight]:
    """The file's 2-D tensors in a format the kernels take, by GGUF name (blk.0.attn_q.weight,
    token_embd.weight, ...); the others (F32 norms, K-quants) are left to the float model."""
    import gguf  # the reader; imported here as only GGUF sources need it

    weights = {}
    for tensor in gguf.GGUFReader(path).tensors:
        fmt = int(tensor.tensor_type)
        if fmt not in BLOCK_BYTES or len(tensor.shape) != 2:
            continue
        cols, rows = (int(size) for size in tensor.shape)  # GGUF lists the fastest dimension first
        if cols % BLOCK_WEIGHTS:
            continue
        data = np.ascontiguousarray(tensor.data, dtype=np.uint8).reshape(rows, cols // BLOCK_WEIGHTS * BLOCK_BYTES[fmt])
        weights[tensor.name] = PackedWeight(fmt, torch.from_numpy(data.copy()), cols)
    return weights
