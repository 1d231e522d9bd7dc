"""Which part of each weight a tensor-parallel rank keeps: the Megatron split of a
Llama-shaped model, as one plan per parameter name (`cut_for`), applied while a shard
reads its checkpoint (sliced_load.py: only its slices are read). Families that transformers
gives a plan of column- and row-split products under the same names (Gemma, OLMo, ...)
are cut the same way, their vocabulary kept whole.

Each layer's q/k/v projections keep this rank's attention heads and KV heads (rows), its
gate/up projections this rank's part of the intermediate size; o_proj and down_proj keep
the matching input columns, so their products are partial sums that the forward adds
across shards (their bias is added once: rank 0 keeps it, the others hold zeros). The
embedding and the output head keep this rank's rows of the vocabulary. Norms stay whole.
The split runs before the sibling projections are fused and before weights are packed
(fused_projections.py, cpu_linear.py), so both work on the parts as on a whole model.
What the split cannot divide evenly is an error naming the numbers, raised before
anything is cut.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workers.contract.model_shape import SplitShape, is_direct_family
from workers.parallel.shard_group import TensorRank

# The products split by their input columns: each shard's output is a partial sum.
ROW_SPLIT = ("o_proj", "down_proj")


class TensorSplitError(ValueError):
    """The model cannot be split over this many shards."""


@dataclass(frozen=True)
class Cut:
    """Keep [start, end) along `dim`; `zero`: keep the shape but hold zeros (a row-split
    product's bias on ranks other than 0)."""

    dim: int
    start: int = 0
    end: int = 0
    zero: bool = False


def cut_for(name: str, shape: SplitShape, position: TensorRank, vocab_split: bool = True) -> Cut | None:
    """This rank's part of the parameter `name` (an unfused checkpoint name); None: whole.
    `vocab_split` False: the embedding and output head stay whole (a family split through
    transformers' forward, transformers_split.py)."""
    parts = name.split(".")
    owner, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", name)
    q = _part(shape.heads * shape.head_dim, position)
    kv = _part(shape.kv_heads * shape.head_dim, position)
    mlp = _part(shape.intermediate, position)
    if owner == "q_proj":
        return Cut(0, *q)
    if owner in ("k_proj", "v_proj"):
        return Cut(0, *kv)
    if owner in ("gate_proj", "up_proj"):
        return Cut(0, *mlp)
    if owner in ROW_SPLIT:
        if kind == "bias":
            return None if position.rank == 0 else Cut(0, zero=True)
        return Cut(1, *(q if owner == "o_proj" else mlp))
    if owner in ("embed_tokens", "lm_head") and vocab_split:
        return Cut(0, *position.vocab_range(shape.vocab))
    return None


def weight_cuts(config, position: TensorRank) -> Callable[[str], tuple[int, int, int] | None]:
    """This rank's (dim, start, end) of each weight by name (None: whole), for the packed
    weights a quantized source keeps (workers/model/packed_swap.py's ShardCut)."""
    shape, vocab_split = SplitShape.of(config), is_direct_family(config)

    def cut(name: str) -> tuple[int, int, int] | None:
        found = cut_for(name, shape, position, vocab_split)
        return None if found is None or found.zero else (found.dim, found.start, found.end)

    return cut


def apply_cut(tensor: torch.Tensor, cut: Cut | None) -> torch.Tensor:
    if cut is None:
        return tensor
    if cut.zero:
        return torch.zeros_like(tensor)
    return tensor.narrow(cut.dim, cut.start, cut.end - cut.start)


def set_parameter(model: nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(value, requires_grad=False))


def sync_module_sizes(model: nn.Module) -> None:
    """Linear and embedding layers' recorded sizes, after their weights were cut."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif isinstance(module, nn.Embedding):
            module.num_embeddings = module.weight.shape[0]


def _part(size: int, position: TensorRank) -> tuple[int, int]:
    per = size // position.world
    return position.rank * per, (position.rank + 1) * per
