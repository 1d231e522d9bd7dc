"""Loading a worker's model, or one shard's part of it (split by tensors or layers), on the calling
thread's torch threads."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from workers.contract.model_config import ModelConfig
from workers.contract.model_shape import stage_problem
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import pack_linear_layers
from workers.model.fused_projections import fuse_sibling_projections
from workers.model.loader import (
    LoadedModel,
    PackedSource,
    keep_weights_packed,
    load_model,
    prepare_model_dir,
    resolve_dtype,
)
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import ShardLayout
from workers.parallel.sliced_load import load_split_model
from workers.parallel.tensor_split import TensorSplitError, weight_cuts
from workers.serving.cpu_budget import cpu_budget
from workers.serving.host_memory import keep_freed_memory


def load_part(config: ModelConfig, rank: int) -> tuple[LoadedModel, StageLayers | None]:
    """The model, or shard `rank`'s part of it read slice by slice from the checkpoint
    (workers/parallel/sliced_load.py): its tensor part of its pipeline stage (returned
    too), per `config.parallel`; on this thread's torch threads. A part is fused, given its
    part of a quantized source's packed weights, and packed after it is cut. A model the split cannot divide is a ValueError naming the field."""
    set_torch_threads(config)
    if config.device == "cpu":
        keep_freed_memory()
    attn = register_paged_attention()
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    layout = shard_layout(config)
    if layout.world == 1:
        return load_model(config.source, config.device, config.dtype, cache_dir, attn_implementation=attn,
                          pack_cpu_weights=config.pack_cpu_weights, fuse_projections=config.fuse_projections,
                          quantization=config.quantization, quantized_activations=config.quantized_activations), None
    path = prepare_model_dir(config.source, cache_dir)
    hf_config = AutoConfig.from_pretrained(path)
    stage = None
    if layout.stages > 1:
        reason = stage_problem(hf_config, layout.stages)
        if reason is not None:
            raise ValueError(f"model {config.id!r}: parallel.pipeline_parallel_size: {reason}")
        stage = StageLayers.of(layout.stage_of(rank), layout.stages, hf_config.num_hidden_layers)
    packed = PackedSource.of(config.source) if config.quantization == "auto" and config.device == "cpu" else None
    dtype = _split_dtype(config, hf_config, quantized=packed is not None)
    try:
        model = load_split_model(path, layout.position(rank), dtype, config.device, attn, stage)
    except TensorSplitError as exc:
        raise ValueError(f"model {config.id!r}: parallel.{config.parallel.split_field}: {exc}") from None
    if (path / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(path)
    fuse_sibling_projections(model)  # the direct forward runs fused siblings
    if packed is not None:  # the source's packed weights, this shard's part
        keep_weights_packed(model, packed, config.quantized_activations, weight_cuts(hf_config, layout.position(rank)))
    if config.pack_cpu_weights:
        pack_linear_layers(model)
    return LoadedModel(model=model, tokenizer=AutoTokenizer.from_pretrained(path), path=path), stage


def shard_layout(config: ModelConfig) -> ShardLayout:
    return ShardLayout(config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size)


def _split_dtype(config: ModelConfig, hf_config, quantized: bool) -> torch.dtype:
    dtype = resolve_dtype(config.dtype, config.device, quantized)
    if isinstance(dtype, torch.dtype):
        return dtype
    declared = hf_config.dtype  # `auto` on cuda: the checkpoint's own
    return declared if isinstance(declared, torch.dtype) else torch.float32


def set_torch_threads(config: ModelConfig) -> None:
    # Ray sets OMP_NUM_THREADS=1 inside actors; on CPU that would halve throughput. The
    # default is the CPUs the container may use (its CPU quota), not the node's cores.
    # A split model's shards share the budget (each a process of its own).
    if config.device == "cpu":
        threads = config.engine.torch_threads or max(1, cpu_budget() // config.parallel.shards)
        torch.set_num_threads(threads)
