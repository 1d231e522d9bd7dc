"""A LoRA adapter cut like the layers it adapts on a tensor-parallel shard (tensor_split.py).

A column-split layer (q/k/v, gate/up) keeps its output rows: the adapter's B keeps the
same rows and A stays whole, so the shard's delta is its columns of the whole delta. A
row-split layer (o_proj, down_proj) keeps its input columns: A keeps the same columns and B
stays whole, so the shard's delta is a partial sum, added across shards by the all-reduce
the base product's partial sum already takes. A pipeline stage keeps the modules of its
own layers. The driver sends each shard the whole adapter once, when it writes it into a
slot; each shard cuts its own part.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from workers.contract.lora import LoraAdapterError
from workers.contract.model_shape import SplitShape
from workers.lora.manager import LORA_TARGETS
from workers.lora.peft_files import LoraAdapter, LoraModule
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import TensorRank
from workers.parallel.tensor_split import cut_for

_LAYER_MODULE = re.compile(r"model\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<owner>\w+)")


class AdapterCut:
    """A shard's part of a split model as its LoRA manager sees it (workers/lora/manager.py's
    ModelPart): adapters cut to its tensor part; the layers of its pipeline stage."""

    def __init__(self, config: Any, position: TensorRank, stage: StageLayers | None = None) -> None:
        self.shape = SplitShape.of(config)
        self.hidden = config.get_text_config().hidden_size
        self.layers = config.get_text_config().num_hidden_layers
        self.position = position
        self.stage = stage

    def part(self, adapter: LoraAdapter) -> LoraAdapter:
        return cut_adapter(adapter, self.shape, self.position)

    def holds(self, module: str) -> bool:
        return self.stage is None or self.stage.holds(module + ".weight", tied=False)

    def expected(self, module: str) -> tuple[int, int] | None:
        match = _LAYER_MODULE.fullmatch(module)
        if match is None or int(match["layer"]) >= self.layers or match["owner"] not in LORA_TARGETS:
            return None
        shape, hidden = self.shape, self.hidden
        out_features, in_features = {
            "q_proj": (shape.heads * shape.head_dim, hidden),
            "k_proj": (shape.kv_heads * shape.head_dim, hidden),
            "v_proj": (shape.kv_heads * shape.head_dim, hidden),
            "o_proj": (hidden, shape.heads * shape.head_dim),
            "gate_proj": (shape.intermediate, hidden),
            "up_proj": (shape.intermediate, hidden),
            "down_proj": (hidden, shape.intermediate),
        }[match["owner"]]
        cut = cut_for(module + ".weight", shape, self.position)
        if cut is not None and cut.dim == 0:
            out_features = cut.end - cut.start
        elif cut is not None:
            in_features = cut.end - cut.start
        return out_features, in_features


def cut_adapter(adapter: LoraAdapter, shape: SplitShape, position: TensorRank) -> LoraAdapter:
    """`adapter`'s part for the shard at `position`; LoraAdapterError (naming the adapter)
    when a module's whole size is not the model's."""
    return dataclasses.replace(adapter, modules={name: _cut_module(adapter, name, weights, shape, position)
                                                 for name, weights in adapter.modules.items()})


def _cut_module(adapter: LoraAdapter, name: str, weights: LoraModule, shape: SplitShape,
                position: TensorRank) -> LoraModule:
    cut = cut_for(name + ".weight", shape, position)
    if cut is None:
        return weights
    # The cut side of the adapter: B's rows for a column-split layer, A's columns for a row-split one.
    side = weights.b if cut.dim == 0 else weights.a
    whole = (cut.end - cut.start) * position.world
    if side.shape[cut.dim] != whole:
        raise LoraAdapterError(f"LoRA adapter {adapter.name!r}: {name!r} has {side.shape[cut.dim]} "
                               f"{'output' if cut.dim == 0 else 'input'} features, the model's layer {whole} "
                               "(another base model?)")
    part = side.narrow(cut.dim, cut.start, cut.end - cut.start).contiguous()
    return LoraModule(weights.a, part) if cut.dim == 0 else LoraModule(part, weights.b)
