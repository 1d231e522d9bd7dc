"""bfloat16 linear layers on CPU with their weights packed once for oneDNN.

`torch.nn.functional.linear` in bfloat16 on CPU reorders the weight into oneDNN's blocked
layout on every call; a decode step calls it ~200 times. Reordering once at load time
(what torch.compile's CPU freezing and IPEX do) makes each call 1.5-2.8x faster on this
AMX machine; the default model's decode step is 1.2-1.4x faster than plain bfloat16 and
1.2x (batch 1) to 2.3x (batch 64) faster than float32 (docs/BENCHMARKS.md, "bfloat16 on
this CPU"). The results are plain bfloat16's: both accumulate in float32. A weight tied
to the input embedding is packed as a copy (the embedding keeps its own).
"""

from __future__ import annotations

import torch
from torch import nn


def onednn_bf16_available() -> bool:
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def has_native_bf16_matmul() -> bool:
    """True on CPUs with AMX tiles (Sapphire Rapids and later), where bfloat16 matmuls run
    on the matrix unit: there bfloat16 beats float32 at every batch size. Elsewhere
    bfloat16 is emulated or vector-only, and float32 stays the safe default."""
    return onednn_bf16_available() and bool(torch.cpu._is_amx_tile_supported())


def _packable(module: nn.Module) -> bool:
    """A plain nn.Linear with a bfloat16 weight on the CPU. Subclasses are left alone (they
    may compute differently), and so are layers a model keeps in another dtype."""
    return (type(module) is nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.bfloat16)


class PackedLinear(nn.Module):
    """An `nn.Linear` whose weight lives only in oneDNN's packed layout.

    `weight` is kept as a meta tensor so code that reads a layer's shape or dtype (the
    engine reads the vocabulary size off the output embedding) still works; computing
    with it fails loudly instead of silently using stale numbers."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        self.weight = torch.empty(linear.weight.shape, dtype=linear.weight.dtype, device="meta")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(model: nn.Module) -> int:
    """Swap every plain bfloat16 CPU `nn.Linear` of `model` for a PackedLinear, in place.
    Returns how many were swapped (0 for a float32 or CUDA model, or without oneDNN)."""
    if not onednn_bf16_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if _packable(child):
                setattr(parent, name, PackedLinear(child))
                swapped += 1
    return swapped
