"""One shard's part of a checkpoint, read from its safetensors files slice by slice: the
model is built on the meta device and each parameter is filled with only the rows or
columns a tensor rank keeps (tensor_split.py), or only a pipeline stage's layers
(pipeline.py; the rest stay on the meta device), so a shard's host memory holds its part
of the weights, never the whole model."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from workers.contract.model_shape import (
    SplitShape,
    is_direct_family,
    split_problem,
    stage_problem,
)
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import TensorRank
from workers.parallel.tensor_split import (
    Cut,
    TensorSplitError,
    apply_cut,
    cut_for,
    set_parameter,
    sync_module_sizes,
)

logger = logging.getLogger(__name__)


def load_split_model(path: Path, position: TensorRank, dtype: torch.dtype, device: str,
                     attn_implementation: str | None = None, stage: StageLayers | None = None) -> nn.Module:
    """`position`'s tensor part of the causal LM in `path` (safetensors files), of pipeline
    `stage`'s layers only when given, on `device`, unfused and unpacked; raises TensorSplitError when the
    model cannot be split so."""
    config = AutoConfig.from_pretrained(path)
    reason = split_problem(config, position.world) or (stage_problem(config, stage.stages) if stage else None)
    if reason is not None:
        raise TensorSplitError(reason)
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise TensorSplitError(f"{path} has no safetensors files to read a shard's slices from")
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    _init_buffers(model, device)
    _fill(model, files, SplitShape.of(config), position, dtype, device, stage, is_direct_family(config))
    return model.eval()


def _fill(model: nn.Module, files: list[Path], shape: SplitShape, position: TensorRank, dtype: torch.dtype,
          device: str, stage: StageLayers | None, vocab_split: bool) -> None:
    tied = bool(model.config.tie_word_embeddings)
    expected = {name: p for name, p in model.named_parameters() if stage is None or stage.holds(name, tied)}
    filled: set[str] = set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as checkpoint:
            for name in checkpoint.keys():
                if name not in expected:
                    continue  # e.g. a checkpoint's unused rotary buffers
                value = _read(checkpoint.get_slice(name), cut_for(name, shape, position, vocab_split))
                set_parameter(model, name, value.to(device=device, dtype=dtype))
                filled.add(name)
    if tied and (stage is None or stage.last):
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
        filled.add("lm_head.weight")
    missing = sorted(set(expected) - filled)
    if missing:
        raise TensorSplitError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    sync_module_sizes(model)


def _read(tensor_slice, cut: Cut | None) -> torch.Tensor:
    """The cut of one checkpoint tensor, read without the rest (a whole tensor, or a bias
    held as zeros, is read whole: `apply_cut`)."""
    if cut is None or cut.zero:
        return apply_cut(tensor_slice[:], cut)
    if cut.dim == 0:
        return tensor_slice[cut.start : cut.end]
    return tensor_slice[:, cut.start : cut.end]


def _init_buffers(model: nn.Module, device: str) -> None:
    """Buffers the checkpoint does not hold (rotary frequencies, Gemma's embedding scale)
    are computed at construction; on the meta device they are empty, so each is made on
    `device` and set by transformers' own initializer of its module. Runs before the
    weights are read: the initializer also draws the module's parameters, which are still
    on the meta device then (a no-op)."""
    for module in model.modules():
        meta = [name for name, buffer in module.named_buffers(recurse=False) if buffer.is_meta]
        for name in meta:
            buffer = getattr(module, name)
            persistent = name not in module._non_persistent_buffers_set
            module.register_buffer(name, torch.empty_like(buffer, device=device), persistent=persistent)
        if meta:
            model._init_weights(module)
    leftover = [name for name, buffer in model.named_buffers() if buffer.is_meta]
    if leftover:
        raise TensorSplitError(f"buffers left unset after loading a shard: {leftover[:3]}")
