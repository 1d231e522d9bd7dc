"""Swap a float model's linears, loaded from a GPTQ, AWQ or FP8 checkpoint's float copy
(quantized_checkpoint.py), for layers holding the checkpoint's own weights: 4-bit ones
(workers/quant/int4_blocks.py) or float8 codes (workers/quant/fp8_blocks.py), through
packed_swap.py.

The checkpoint's quantized tensors are read again (memory-mapped) and rewritten into
blocks; each is checked against the float copy's weight it replaces, rounded as that copy
was (to the config's dtype), so a module name or layout that does not hold keeps the layer
in float instead of computing wrong numbers.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workers.model.packed_swap import (
    Match,
    ShardCut,
    cut_packed,
    same_weight,
    swap_in_packed,
    whole,
)
from workers.model.quantized_checkpoint import (
    target_dtype,
    unpack_awq,
    unpack_int4_columns,
    unpack_int4_rows,
    weight_files,
)
from workers.quant.fp8_blocks import fp8_blocks
from workers.quant.int4_blocks import int4_blocks
from workers.quant.native_kernels import QuantKernels, kernels
from workers.quant.quantized_layers import natural_columns

logger = logging.getLogger(__name__)


# The tensors of one quantized linear, by the suffix after its module's name.
INT4_PARTS = ("qweight", "qzeros", "scales", "g_idx")
FP8_PARTS = ("weight", "weight_scale_inv", "weight_scale")
FP8_DTYPE = "F8_E4M3"  # safetensors' name for float8_e4m3fn


def keep_checkpoint_weights_packed(model: nn.Module, checkpoint: Path, method: str, activations: str = "int8x2",
                                   cut: ShardCut = whole, device: str = "cpu") -> Counter:
    """Replace, in place, each linear of `model` (fused groups whole) whose GPTQ, AWQ or FP8
    weight in `checkpoint` (`cut` to a tensor-parallel shard's part) reproduces it; returns
    how many of each format were replaced."""
    quant = kernels()
    if quant is None:
        return Counter()
    config = json.loads((checkpoint / "config.json").read_text())
    settings = config["quantization_config"]
    matched, refused = {}, []
    with ExitStack() as stack:
        tensors = {}
        for file in weight_files(checkpoint):
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            tensors.update({key: handle for key in handle.keys()})
        names = INT4_PARTS if method in ("gptq", "awq") else FP8_PARTS
        for prefix in _quantized_modules(method, tensors):
            module = _module(model, prefix)
            if module is None or module.weight.is_meta:
                continue  # not this model's, or a layer of another pipeline stage
            parts = {name: tensors[f"{prefix}.{name}"].get_tensor(f"{prefix}.{name}")
                     for name in names if f"{prefix}.{name}" in tensors}
            match = _reproducing(module, _blocks(method, settings, parts), cut(f"{prefix}.weight"), quant,
                                 target_dtype(config))
            if match is None:
                refused.append(prefix)
            else:
                matched[id(module)] = match
    if refused:
        logger.warning("%d %s weights were not kept packed (%s): those layers stay in float", len(refused),
                       method, ", ".join(refused[:4]) + (" ..." if len(refused) > 4 else ""))
    return swap_in_packed(model, matched, quant, activations, device)


def _quantized_modules(method: str, tensors: dict) -> list[str]:
    """The names of the checkpoint's quantized linears: those with a GPTQ/AWQ `qweight`, or
    an e4m3 `weight` (FP8; other float8 kinds stay float)."""
    if method in ("gptq", "awq"):
        return sorted(key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight"))
    return sorted(key.removesuffix(".weight") for key, handle in tensors.items()
                  if key.endswith(".weight") and handle.get_slice(key).get_dtype() == FP8_DTYPE)


def _blocks(method: str, settings: dict, parts: dict[str, torch.Tensor]):
    """The blocks (and input order, or None) of one checkpoint linear, or None."""
    if method == "fp8":
        block_size = settings.get("weight_block_size") if "weight_scale_inv" in parts else None
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        packed = None if scale is None else fp8_blocks(parts["weight"], scale, block_size)
        return None if packed is None else (packed, None)
    group_size = int(settings.get("group_size", settings.get("q_group_size", 128)))
    if method == "gptq":
        q = unpack_int4_rows(parts["qweight"])
        zero_offset = 0 if settings.get("checkpoint_format") == "gptq_v2" else 1  # v1 stores zero - 1
        zeros = unpack_int4_columns(parts["qzeros"]) + zero_offset
        groups = parts.get("g_idx")
    else:
        q, zeros, groups = unpack_awq(parts["qweight"]), unpack_awq(parts["qzeros"]), None
    if groups is None:
        groups = torch.arange(q.shape[0]) // (q.shape[0] if group_size == -1 else group_size)
    return int4_blocks(q, zeros, parts["scales"], groups)


def _module(model: nn.Module, prefix: str) -> nn.Module | None:
    try:
        module = model.get_submodule(prefix)
    except AttributeError:
        return None
    return module if hasattr(module, "weight") else None


def _reproducing(module: nn.Module, converted, shard: tuple[int, int, int] | None, quant: QuantKernels,
                 stored: torch.dtype) -> Match | None:
    """The match for `module` when the converted blocks, cut to the shard's part,
    reproduce its weight."""
    if converted is None:
        return None
    packed, order = converted
    if order is not None and shard is not None and shard[0] == 1:
        return None  # a shard's input columns are not a range of the act-order layout
    packed = cut_packed(packed, shard)
    weight = module.weight
    if packed is None or weight.shape != (packed.rows, packed.cols) or weight.device.type != "cpu":
        return None
    dequantized = quant.dequantize(packed.fmt, packed.blocks, packed.cols, torch.empty(packed.rows, packed.cols))
    dequantized = natural_columns(dequantized, order)
    return Match(packed, order) if same_weight(dequantized, weight, stored) else None
