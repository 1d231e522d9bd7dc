"""Sibling projections that read the same input, computed as one matrix multiply.

transformers' attention calls `q_proj(x)`, `k_proj(x)` and `v_proj(x)` one after the
other, and its gated MLP `gate_proj(x)` and `up_proj(x)`: seven weight passes a layer
where three would do. One wide multiply streams the same weights with fewer calls and
a larger output dimension per call. On the 2-core AVX2 CPU the default model's linear
layers alone take 12-13 % less time at 1 and 64 rows, and its whole decode step 4-5 % less
at batch 1 and 0-2 % at 16-64 (docs/BENCHMARKS.md); on a GPU it is the usual fusion
(vLLM's QKVParallelLinear / MergedColumnParallelLinear), not measured there yet.

The model's code is left as it is: each sibling becomes a `ProjectionSlice` of one shared
`FusedProjection`. The first sibling called with an input computes the wide product
once; the others called with that same tensor take their columns of it (views, no
copy). Any other call order or input still gives the right answer: a sibling that finds
no product for its input (a different tensor, or its own columns already taken) computes
the wide product anew. What this assumes: nothing writes into the input tensor in place
between the siblings' calls (inference tensors keep no version counter to check it by);
transformers' modules call them back to back on the same hidden states. The product is
held until every sibling took its columns or the input tensor is freed, whichever comes
first: a model that skips a sibling (layers sharing another layer's K/V) holds no
layer's product past that layer.
"""

from __future__ import annotations

import weakref
from itertools import accumulate

import torch
from torch import nn

# Child names of one module that are fused when all of them are plain linears of the
# same input width, dtype and device: Llama-style attention and gated MLPs (Llama,
# Mistral, Qwen2/3, Gemma 1-3, SmolLM, and the attention of most vision towers).
SIBLING_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjection(nn.Module):
    """The siblings' weights stacked into one `nn.Linear` (which CPU packing may swap for
    a PackedLinear later), and the last product it computed, until every sibling took
    its share of it."""

    def __init__(self, linears: list[nn.Linear]):
        super().__init__()
        first = linears[0]
        has_bias = first.bias is not None
        self.linear = nn.Linear(first.in_features, sum(lin.out_features for lin in linears), bias=has_bias,
                                device="meta", dtype=first.weight.dtype)
        with torch.no_grad():
            self.linear.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
            if has_bias:
                self.linear.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
        ends = list(accumulate(lin.out_features for lin in linears))
        self.bounds = list(zip([0] + ends[:-1], ends))
        self._clear()

    def _clear(self) -> None:
        self._input: weakref.ref | None = None  # weak: the product must not keep the input alive
        self._product: torch.Tensor | None = None
        self._taken: set[int] = set()

    def _input_freed(self, ref: weakref.ref) -> None:
        if self._input is ref:
            self._clear()

    def columns(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Sibling `index`'s output for input `x`."""
        if self._input is None or self._input() is not x or index in self._taken:
            self._product = self.linear(x)
            self._input, self._taken = weakref.ref(x, self._input_freed), set()
        start, end = self.bounds[index]
        out = self._product[..., start:end]
        self._taken.add(index)
        if len(self._taken) == len(self.bounds):
            self._clear()  # every sibling served: hold neither the input nor the product
        return out


class ProjectionSlice(nn.Module):
    """Stands where one sibling linear stood; reads as a linear of its own shape."""

    def __init__(self, fused: FusedProjection, index: int):
        super().__init__()
        if index == 0:
            self.fused = fused  # registered once (under the first sibling): moved, packed, counted once
        else:
            object.__setattr__(self, "fused", fused)
        self.index = index
        start, end = fused.bounds[index]
        self.in_features, self.out_features = fused.linear.in_features, end - start

    @property
    def weight(self) -> torch.Tensor:
        """The sibling's rows of the stacked weight (a view; shape and dtype only, on a meta
        tensor, once CPU packing has taken the values into oneDNN's layout)."""
        start, end = self.fused.bounds[self.index]
        return self.fused.linear.weight[start:end]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.fused.linear.bias
        if bias is None:
            return None
        start, end = self.fused.bounds[self.index]
        return bias[start:end]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.columns(self.index, x)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fused part {self.index}"


def _fusable(linears: list[nn.Module]) -> bool:
    if not all(type(lin) is nn.Linear for lin in linears):
        return False  # subclasses (quantized, LoRA) may compute differently
    first = linears[0]
    return all(lin.in_features == first.in_features and lin.weight.dtype == first.weight.dtype
               and lin.weight.device == first.weight.device and (lin.bias is None) == (first.bias is None)
               for lin in linears)


def fuse_sibling_projections(model: nn.Module) -> int:
    """Replace each fusable sibling group of `model` (SIBLING_GROUPS) by slices of one
    FusedProjection, in place. Returns how many groups were fused."""
    fused_groups = 0
    for parent in list(model.modules()):
        children = dict(parent.named_children())
        for names in SIBLING_GROUPS:
            linears = [children.get(name) for name in names]
            if any(lin is None for lin in linears) or not _fusable(linears):
                continue
            fused = FusedProjection(linears)
            for index, name in enumerate(names):
                setattr(parent, name, ProjectionSlice(fused, index))
            fused_groups += 1
    return fused_groups
