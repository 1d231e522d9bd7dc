"""Swap a float model's layers, loaded from a GGUF file's float conversion, for layers that
keep the file's quantized blocks (quantized_layers.py).

The float model is the skeleton: its config, norms and layer structure come from
transformers' conversion as before, and each linear or embedding whose GGUF tensor is in
a format the kernels take is replaced. A replacement is checked against the float
weight it replaces (its dequantized rows must equal it, up to the float dtype's rounding)
before it goes in, so a name mapping or row order that does not hold for some
architecture keeps that layer in float instead of computing wrong numbers. llama.cpp's
converter stores q and k of Llama-family models with their rows interleaved per head
(for its rotary layout); transformers' loader undoes that (LlamaTensorProcessor), and this
applies the same rule to whole byte rows.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from workers.model.fused_projections import FusedProjection, ProjectionSlice
from workers.quant.native_kernels import QuantKernels, kernels
from workers.quant.packed_weights import PackedWeight, read_gguf_weights
from workers.quant.quantized_layers import QuantizedEmbedding, QuantizedLinear

logger = logging.getLogger(__name__)

# GGUF tensor name within block N -> the module path within transformers' layer N.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def keep_gguf_weights_packed(model: nn.Module, gguf: Path, activations: str = "int8x2") -> Counter:
    """Replace `model`'s layers by quantized ones from `gguf`, in place (after sibling
    projections are fused: a fused group is replaced by its siblings' stacked rows).
    `activations`: int8x2, int8 or float32, how the linears take their input (QuantizedLinear).
    Returns how many layers of each format were replaced (none without the kernels)."""
    quant = kernels()
    if quant is None:
        return Counter()
    matched = _matched_weights(model, read_gguf_weights(gguf), quant)
    replaced: Counter = Counter()
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # The output head multiplies exactly: rounding its input moves near-tied logits
            # (the default model's first answer token to "What is the capital of France?"
            # is 0.3 % ahead of the next, and 8-bit activations swap them).
            layer_activations = activations if child is not head else "float32"
            swap = _replacement(child, matched.get(id(child)), quant, layer_activations)
            if swap is not None:
                setattr(parent, name, swap)
                replaced[swap.format_name] += 1
    for fused, siblings in _fused_groups(model).items():
        parts = [matched.get(id(sibling)) for sibling in siblings]
        if all(part is not None for part in parts) and len({part.fmt for part in parts}) == 1:
            fused.linear = QuantizedLinear(PackedWeight.stacked(parts), quant, fused.linear.bias,
                                           fused.linear.weight.dtype, activations)
            replaced[fused.linear.format_name] += 1
    return replaced


def _fused_groups(model: nn.Module) -> dict[FusedProjection, list[ProjectionSlice]]:
    """Each fused group and its sibling slices, in the order of their rows."""
    groups: dict[FusedProjection, list[ProjectionSlice]] = {}
    for module in model.modules():
        for child in module.children():
            if isinstance(child, ProjectionSlice):
                groups.setdefault(child.fused, []).append(child)
    return {fused: sorted(slices, key=lambda part: part.index) for fused, slices in groups.items()}


def _matched_weights(model: nn.Module, weights: dict[str, PackedWeight], quant: QuantKernels) -> dict[int, PackedWeight]:
    """id(float module) -> its packed weight, for each module whose float weight the packed
    one reproduces (a ProjectionSlice's sibling weight included)."""
    body = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    candidates: list[tuple[str, nn.Module]] = []  # (GGUF name, the module it would replace)
    embed = model.get_input_embeddings()
    if "token_embd.weight" in weights:
        candidates.append(("token_embd.weight", embed))
    output = model.get_output_embeddings()
    head_name = "output.weight" if "output.weight" in weights else "token_embd.weight"
    if head_name in weights and (head_name == "output.weight" or output.weight is embed.weight):
        candidates.append((head_name, output))
    for index, layer in enumerate(body.layers):
        for gguf_name, path in LAYER_TENSORS.items():
            name = f"blk.{index}.{gguf_name}.weight"
            if name in weights:
                candidates.append((name, layer.get_submodule(path)))
    # transformers' own rule for the rows of each tensor, applied to row numbers
    rows_rule = LlamaTensorProcessor(config={"num_attention_heads": config.num_attention_heads,
                                             "num_key_value_heads": config.num_key_value_heads})
    matched, refused = {}, []
    for name, module in candidates:
        packed = weights[name]
        loader_order = torch.from_numpy(rows_rule.process(np.arange(packed.rows), name).weights.copy())
        found = _reproducing(module.weight, packed, quant, loader_order)
        if found is None:
            refused.append(name)
        else:
            matched[id(module)] = found
    if refused:
        logger.warning("%d GGUF weights do not reproduce the float model's (%s): those layers stay in float",
                       len(refused), ", ".join(refused[:4]) + (" ..." if len(refused) > 4 else ""))
    return matched


def _reproducing(weight: torch.Tensor, packed: PackedWeight, quant: QuantKernels,
                 loader_order: torch.Tensor) -> PackedWeight | None:
    """`packed`, in the file's row order or in the one transformers' loader gave the float
    model, whichever reproduces `weight`; None when neither does."""
    if weight.shape != (packed.rows, packed.cols) or weight.device.type != "cpu":
        return None
    reordered = not torch.equal(loader_order, torch.arange(packed.rows))
    for candidate in [packed] + ([packed.select_rows(loader_order)] if reordered else []):
        dequantized = quant.dequantize(candidate.fmt, candidate.blocks, candidate.cols,
                                       torch.empty(candidate.rows, candidate.cols))
        if _same_weight(dequantized, weight):
            return candidate
    return None


def _same_weight(dequantized: torch.Tensor, weight: torch.Tensor) -> bool:
    expected = weight.detach().to(torch.float32)
    rounded = dequantized.to(weight.dtype).to(torch.float32)  # the float model's own rounding
    return bool(torch.equal(rounded, expected))


def _replacement(child: nn.Module, packed: PackedWeight | None, quant: QuantKernels,
                 activations: str) -> nn.Module | None:
    if packed is None:
        return None
    if isinstance(child, nn.Embedding):
        return QuantizedEmbedding(packed, quant, child.weight.dtype)
    if type(child) is nn.Linear:
        return QuantizedLinear(packed, quant, child.bias, child.weight.dtype, activations)
    return None  # a sibling slice (its fused group is replaced whole)
