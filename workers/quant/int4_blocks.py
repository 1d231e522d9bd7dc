"""GPTQ and AWQ 4-bit weights rewritten, exactly, as blocks the kernels take.

Both formats hold, for each input row i and output column j, a 4-bit q, and per group of
input rows a scale s and zero z: W[j, i] = s[g, j] (q[i, j] - z[g, j]). With groups of a
multiple of 32 inputs, each block of 32 inputs of an output row shares one group, so it is
a Q4_F32 block (k_quants.py's format): d = s, m = -s z (exact in float32: an fp16 scale
times an integer of 5 bits), w = d q + m. GPTQ's act-order checkpoints give input rows
their groups in a shuffled order; the rows are then sorted by group (the layer gathers
its input into that order), so the blocks again hold one group each.
"""

from __future__ import annotations

import torch

from workers.quant.k_quants import Q4_F32
from workers.quant.packed_weights import BLOCK_WEIGHTS, PackedWeight


def int4_blocks(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                groups: torch.Tensor) -> tuple[PackedWeight, torch.Tensor | None] | None:
    """(Q4_F32 blocks of the [out, in] weight, the input order they hold or None for the
    natural one) from q [in, out] (0..15), zeros and scales [groups, out], and each input
    row's group [in]; None when a block of 32 inputs would span two groups."""
    in_features, out_features = q.shape
    groups = groups.long()
    order = None
    if bool((groups[1:] < groups[:-1]).any()):  # act-order: sort the inputs by group
        order = torch.argsort(groups, stable=True)
        groups, q = groups[order], q[order]
    if in_features % BLOCK_WEIGHTS:
        return None
    per_block = groups.view(-1, BLOCK_WEIGHTS)
    if not bool((per_block == per_block[:, :1]).all()):
        return None
    block_group = per_block[:, 0]
    scale = scales.float()[block_group].t()  # [out, blocks]
    minimum = -(scale * zeros[block_group].t().float())
    fields = torch.stack([scale, minimum], dim=-1).contiguous().view(torch.uint8)  # [out, blocks, 8]
    nibbles = q.t().reshape(out_features, -1, BLOCK_WEIGHTS).to(torch.uint8)
    quants = nibbles[..., :16] | (nibbles[..., 16:] << 4)  # Q4_1's order: byte t holds q[t] and q[t + 16]
    blocks = torch.cat([fields, quants], dim=-1).reshape(out_features, -1).contiguous()
    return PackedWeight(Q4_F32, blocks, in_features), order
