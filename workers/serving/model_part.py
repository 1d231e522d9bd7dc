"""Loading a worker's model, or one tensor-parallel shard's part of it, on the calling
thread's torch threads: fused, split (workers/parallel/tensor_split.py), then packed
(packing is per part)."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.contract.model_config import ModelConfig
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import pack_linear_layers
from workers.model.loader import LoadedModel, load_model
from workers.parallel.tensor_group import TensorRank
from workers.parallel.tensor_split import TensorSplitError, split_model
from workers.serving.cpu_budget import cpu_budget
from workers.serving.host_memory import keep_freed_memory


def load_part(config: ModelConfig, position: TensorRank) -> LoadedModel:
    """The model, or `position`'s part of it, on this thread's torch threads: fused, split,
    then packed (packing is per part). A model the split cannot divide is a ValueError
    naming the config field."""
    set_torch_threads(config)
    if config.device == "cpu":
        keep_freed_memory()
    attn = register_paged_attention()
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    split = position.world > 1
    loaded = load_model(config.source, config.device, config.dtype, cache_dir, attn_implementation=attn,
                        pack_cpu_weights=config.pack_cpu_weights and not split,
                        fuse_projections=config.fuse_projections or split)
    if split:
        try:
            split_model(loaded.model, position)
        except TensorSplitError as exc:
            raise ValueError(f"model {config.id!r}: parallel.tensor_parallel_size: {exc}") from None
        if config.pack_cpu_weights:
            pack_linear_layers(loaded.model)
    return loaded


def set_torch_threads(config: ModelConfig) -> None:
    # Ray sets OMP_NUM_THREADS=1 inside actors; on CPU that would halve throughput. The
    # default is the CPUs the container may use (its CPU quota), not the node's cores.
    # A split model's shards share the budget (each a process of its own).
    if config.device == "cpu":
        threads = config.engine.torch_threads or max(1, cpu_budget() // config.parallel.tensor_parallel_size)
        torch.set_num_threads(threads)
