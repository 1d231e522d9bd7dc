"""Swap a float model's layers, loaded from a GGUF file's float conversion, for layers that
keep the file's quantized blocks (packed_swap.py, workers/quant/).

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

from workers.model.packed_swap import (
    Match,
    ShardCut,
    cut_packed,
    module_names,
    same_weight,
    swap_in_packed,
    whole,
)
from workers.quant.native_kernels import QuantKernels, kernels
from workers.quant.packed_weights import PackedWeight, read_gguf_weights

logger = logging.getLogger(__name__)

# GGUF tensor name within block N -> the module path within transformers' layer N.
LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def keep_gguf_weights_packed(model: nn.Module, gguf: Path, activations: str = "int8x2",
                             cut: ShardCut = whole, device: str = "cpu") -> Counter:
    """Replace `model`'s layers by quantized ones from `gguf`, in place (after sibling
    projections are fused: a fused group is replaced by its siblings' stacked rows).
    `activations`: int8x2, int8 or float32, how the linears take their input (QuantizedLinear).
    `cut`: a tensor-parallel shard's part of each weight; `device`: the layers' (packed_swap.py). Returns how many layers of each
    format were replaced (none without the kernels)."""
    quant = kernels()
    if quant is None:
        return Counter()
    matched = _matched_weights(model, read_gguf_weights(gguf), quant, cut)
    return swap_in_packed(model, {key: Match(packed) for key, packed in matched.items()}, quant, activations, device)


def _matched_weights(model: nn.Module, weights: dict[str, PackedWeight], quant: QuantKernels,
                     cut: ShardCut) -> dict[int, PackedWeight]:
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
    matched, refused, names = {}, [], module_names(model)
    for name, module in candidates:
        if module.weight.is_meta:
            continue  # a layer of another pipeline stage
        packed = weights[name]
        loader_order = torch.from_numpy(rows_rule.process(np.arange(packed.rows), name).weights.copy())
        found = _reproducing(module.weight, packed, quant, loader_order, cut(f"{names[id(module)]}.weight"))
        if found is None:
            refused.append(name)
        else:
            matched[id(module)] = found
    if refused:
        logger.warning("%d GGUF weights do not reproduce the float model's (%s): those layers stay in float",
                       len(refused), ", ".join(refused[:4]) + (" ..." if len(refused) > 4 else ""))
    return matched


def _reproducing(weight: torch.Tensor, packed: PackedWeight, quant: QuantKernels, loader_order: torch.Tensor,
                 shard: tuple[int, int, int] | None) -> PackedWeight | None:
    """`packed`, in the file's row order or in the one transformers' loader gave the float
    model (then cut to the shard's part), whichever reproduces `weight`; None when neither
    does."""
    if weight.device.type != "cpu":
        return None
    reordered = not torch.equal(loader_order, torch.arange(packed.rows))
    for candidate in [packed] + ([packed.select_rows(loader_order)] if reordered else []):
        candidate = cut_packed(candidate, shard)
        if candidate is None or weight.shape != (candidate.rows, candidate.cols):
            continue
        dequantized = quant.dequantize(candidate.fmt, candidate.blocks, candidate.cols,
                                       torch.empty(candidate.rows, candidate.cols))
        if same_weight(dequantized, weight):
            return candidate
    return None
