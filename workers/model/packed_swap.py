"""Swap a float model's linears and embeddings for quantized layers holding packed weights
(workers/quant/), once each packed weight has been matched to the module it replaces.

Shared by the GGUF (gguf_packing.py) and GPTQ/AWQ/FP8 (checkpoint_packing.py) sources: the float
model is the skeleton (config, norms, structure, and the reference every packed weight is
checked against); fused sibling projections (fused_projections.py) are replaced whole, by
their siblings' stacked rows, when every sibling has a packed weight in one format and
input order; the output head multiplies exactly (float32 activations).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.model.fused_projections import FusedProjection, ProjectionSlice
from workers.quant.native_kernels import QuantKernels
from workers.quant.packed_weights import PackedWeight
from workers.quant.quantized_layers import (
    DeviceQuantizedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
)

# A tensor-parallel shard's part of a weight, by the float model's parameter name
# (lm_head.weight, model.layers.0.self_attn.q_proj.weight, ...): (dim, start, end), or None
# for the whole weight. A whole model cuts nothing.
ShardCut = Callable[[str], "tuple[int, int, int] | None"]


def whole(name: str) -> None:
    return None


def cut_packed(packed: PackedWeight | None, cut: tuple[int, int, int] | None) -> PackedWeight | None:
    return packed if packed is None or cut is None else packed.narrow(*cut)


def module_names(model: nn.Module) -> dict[int, str]:
    """id(module) -> its name in `model` (a fused group's sibling slices by their own)."""
    return {id(module): name for name, module in model.named_modules()}


@dataclass(frozen=True)
class Match:
    """A packed weight for one float module: `input_order`, the input columns the packed
    rows hold in order (GPTQ's act-order), or None for the natural order."""
    packed: PackedWeight
    input_order: torch.Tensor | None = None


def same_weight(dequantized: torch.Tensor, weight: torch.Tensor, stored_dtype: torch.dtype | None = None) -> bool:
    """Whether `dequantized` (float32) is `weight`, up to the roundings the float model's
    weight went through: to the dtype its source was stored in (`stored_dtype`), then to
    its own."""
    rounded = dequantized if stored_dtype is None else dequantized.to(stored_dtype)
    return bool(torch.equal(rounded.to(weight.dtype).to(torch.float32), weight.detach().to(torch.float32)))


def swap_in_packed(model: nn.Module, matched: dict[int, Match], quant: QuantKernels, activations: str,
                   device: str = "cpu") -> Counter:
    """Replace, in place, each module of `model` whose id is in `matched` (fused groups whose
    siblings all are), with layers for `device` (the model is still on the CPU; a CUDA
    one's layers take triton_matmul's kernel and its embedding stays float); returns how
    many layers of each format were replaced."""
    replaced: Counter = Counter()
    ready = _head_and_embedding(model, matched, quant, activations, device)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            swap = ready.get(id(child)) or _replacement(child, matched.get(id(child)), quant, activations, device)
            if swap is not None:
                setattr(parent, name, swap)
                replaced[swap.format_name] += 1
    for fused, siblings in _fused_groups(model).items():
        parts = [matched.get(id(sibling)) for sibling in siblings]
        if any(part is None for part in parts) or len({part.packed.fmt for part in parts}) != 1:
            continue
        order = parts[0].input_order
        if not all(_same(part.input_order, order) for part in parts):
            continue  # siblings with other input orders cannot share one product
        fused.linear = _linear(PackedWeight.stacked([part.packed for part in parts]), quant, fused.linear,
                               activations, order, device)
        replaced[fused.linear.format_name] += 1
    return replaced


def _head_and_embedding(model: nn.Module, matched: dict[int, Match], quant: QuantKernels, activations: str,
                        device: str) -> dict[int, nn.Module]:
    """The output head's replacement, and the embedding's when it is tied to the head (then
    reading the head's blocks: one copy). The head never takes one 8-bit rounding (int8):
    the default model's first answer token to "What is the capital of France?" is 0.3 %
    ahead of the next, and one rounding of the head's input alone swaps them; two (int8x2)
    keep it."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    ready: dict[int, nn.Module] = {}
    head_match = matched.get(id(head)) if head is not None else None
    if head_match is None:
        return ready
    layer = _replacement(head, head_match, quant, "float32" if activations == "float32" else "int8x2", device)
    if layer is None:
        return ready
    ready[id(head)] = layer
    embedding_match = matched.get(id(embedding))
    if embedding_match is not None and device == "cpu" and _same_weight_bytes(embedding_match.packed, head_match.packed):
        ready[id(embedding)] = QuantizedEmbedding(head_match.packed, quant, embedding.weight.dtype, tied_head=layer)
    return ready


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b or (a is not None and b is not None and torch.equal(a, b))


def _same_weight_bytes(a: PackedWeight, b: PackedWeight) -> bool:
    """Tied weights: one object, or (a tensor-parallel shard cuts each) equal blocks."""
    return a is b or (a.fmt == b.fmt and a.cols == b.cols and torch.equal(a.blocks, b.blocks))


def _fused_groups(model: nn.Module) -> dict[FusedProjection, list[ProjectionSlice]]:
    """Each fused group and its sibling slices, in the order of their rows."""
    groups: dict[FusedProjection, list[ProjectionSlice]] = {}
    for module in model.modules():
        for child in module.children():
            if isinstance(child, ProjectionSlice):
                groups.setdefault(child.fused, []).append(child)
    return {fused: sorted(slices, key=lambda part: part.index) for fused, slices in groups.items()}


def _replacement(child: nn.Module, match: Match | None, quant: QuantKernels, activations: str,
                 device: str) -> nn.Module | None:
    if match is None:
        return None
    if isinstance(child, nn.Embedding) and match.input_order is None and device == "cpu":
        return QuantizedEmbedding(match.packed, quant, child.weight.dtype)
    if type(child) is nn.Linear:
        return _linear(match.packed, quant, child, activations, match.input_order, device)
    return None  # a sibling slice (its fused group is replaced whole), or a CUDA model's embedding


def _linear(packed: PackedWeight, quant: QuantKernels, linear: nn.Linear, activations: str,
            input_order: torch.Tensor | None, device: str) -> nn.Module:
    if device == "cuda":
        return DeviceQuantizedLinear(packed, linear.bias, linear.weight.dtype, input_order)
    return QuantizedLinear(packed, quant, linear.bias, linear.weight.dtype, activations, input_order=input_order)
