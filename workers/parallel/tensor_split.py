"""Keep one tensor-parallel rank's part of a Llama-shaped model's weights, in place.

The Megatron split, on a model whose sibling projections are fused and not yet packed
(fused_projections.py; packing comes after, on the parts): each layer's q/k/v product
keeps this rank's attention heads and KV heads (rows), and its gate/up product this
rank's part of the intermediate size; o_proj and down_proj keep the matching input
columns, so their products are partial sums that the forward adds across shards. The
embedding and the output head keep this rank's rows of the vocabulary. What the
split cannot divide evenly (heads, KV heads, intermediate size) is an error naming the
numbers, raised before anything is cut.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.direct_forward import unsupported_reason
from workers.model.fused_projections import FusedProjection, ProjectionSlice
from workers.parallel.tensor_group import TensorRank


class TensorSplitError(ValueError):
    """The model cannot be split over this many shards."""


def split_error(model: nn.Module, world: int) -> str | None:
    """Why `model` cannot be split over `world` shards, or None."""
    reason = unsupported_reason(model)
    if reason is not None:
        return f"tensor parallelism runs the direct forward's families only: {reason}"
    config = model.config
    layer = model.model.layers[0]
    sizes = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
             "intermediate size": layer.mlp.gate_proj.out_features}
    uneven = [f"{size} {name}" for name, size in sizes.items() if size % world]
    if uneven:
        return f"tensor_parallel_size {world} does not divide the model's {', '.join(uneven)}"
    return None


def split_model(model: nn.Module, position: TensorRank) -> None:
    """Cut `model` (fused, unpacked) down to `position`'s part, in place."""
    if position.world == 1:
        return
    reason = split_error(model, position.world)
    if reason is not None:
        raise TensorSplitError(reason)
    config, body = model.config, model.model
    for layer in body.layers:
        attn, mlp = layer.self_attn, layer.mlp
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, attn.head_dim
        q, kv = _part(heads * head_dim, position), _part(kv_heads * head_dim, position)
        qkv_rows = [q, _shift(kv, heads * head_dim), _shift(kv, (heads + kv_heads) * head_dim)]
        _keep_fused_rows(attn.q_proj.fused, [attn.q_proj, attn.k_proj, attn.v_proj], qkv_rows)
        attn.o_proj = _keep_columns(attn.o_proj, q, position)
        intermediate = mlp.gate_proj.out_features
        part = _part(intermediate, position)
        _keep_fused_rows(mlp.gate_proj.fused, [mlp.gate_proj, mlp.up_proj], [part, _shift(part, intermediate)])
        mlp.down_proj = _keep_columns(mlp.down_proj, part, position)
    _split_vocabulary(model, position)


def _part(size: int, position: TensorRank) -> tuple[int, int]:
    per = size // position.world
    return position.rank * per, (position.rank + 1) * per


def _shift(span: tuple[int, int], offset: int) -> tuple[int, int]:
    return span[0] + offset, span[1] + offset


def _keep_fused_rows(fused: FusedProjection, slices: list[ProjectionSlice], rows: list[tuple[int, int]]) -> None:
    """Keep `rows` of each sibling's part of the stacked weight (and bias)."""
    linear = fused.linear
    index = torch.cat([torch.arange(start, end) for start, end in rows])
    weight = linear.weight.detach()[index].clone()
    bias = linear.bias.detach()[index].clone() if linear.bias is not None else None
    fused.linear = _linear(weight, bias)
    ends, offset = [], 0
    for start, end in rows:
        offset += end - start
        ends.append(offset)
    fused.bounds = list(zip([0] + ends[:-1], ends))
    for sibling, (start, end) in zip(slices, fused.bounds):
        sibling.out_features = end - start
    fused._clear()


def _keep_columns(linear: nn.Linear, columns: tuple[int, int], position: TensorRank) -> nn.Linear:
    """A row-parallel product: this rank's input columns; the bias is added once (by rank 0)."""
    start, end = columns
    weight = linear.weight.detach()[:, start:end].clone()
    bias = None
    if linear.bias is not None:
        bias = linear.bias.detach().clone() if position.rank == 0 else torch.zeros_like(linear.bias)
    return _linear(weight, bias)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    out_features, in_features = weight.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def _split_vocabulary(model: nn.Module, position: TensorRank) -> None:
    """The embedding's and output head's rows of this rank's part of the vocabulary (one
    tensor when the model ties them)."""
    embed, head = model.model.embed_tokens, model.lm_head
    vocab_size = embed.weight.shape[0]
    start, end = position.vocab_range(vocab_size)
    tied = head.weight is embed.weight
    embed.weight = nn.Parameter(embed.weight.detach()[start:end].clone(), requires_grad=False)
    if tied:
        head.weight = embed.weight
    else:
        head.weight = nn.Parameter(head.weight.detach()[start:end].clone(), requires_grad=False)
    if head.bias is not None:
        head.bias = nn.Parameter(head.bias.detach()[start:end].clone(), requires_grad=False)
    head.out_features = embed.num_embeddings = end - start
