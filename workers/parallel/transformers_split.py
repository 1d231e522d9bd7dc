"""transformers' own forward over a tensor shard's part of a model whose family the direct
forward does not run, but whose transformers config carries a plan of column- and
row-split products (Gemma 1/2/3, OLMo, Granite, ...: model_shape.follows_plan).

The weights are cut as the direct families' are (tensor_split.py), the embedding and the
output head kept whole; a hook after every row-split product (o_proj, down_proj) adds the
shards' partial sums, as the direct forward does. transformers' attention reshapes by
`-1` heads, so each shard runs its own heads through the paged attention unchanged. Only
the driver computes logits: the others ask for none.
"""

from __future__ import annotations

import torch
from torch import nn

from workers.model.attention import AttentionMetadata
from workers.model.direct_forward import DirectForward, unsupported_reason
from workers.parallel.shard_group import ShardGroup
from workers.parallel.tensor_split import ROW_SPLIT


class TransformersShardForward:
    """Stands where a DirectForward stands, for a plan family (see the module's text)."""

    def __init__(self, model: nn.Module, group: ShardGroup) -> None:
        """Call after any LoRA layers wrap the products: the sums must add their deltas too."""
        self.model = model
        self.group = group
        self.vocab_size = model.config.get_text_config().vocab_size
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ROW_SPLIT:
                module.register_forward_hook(self._summed)

    def _summed(self, module: nn.Module, inputs, output: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(output)

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: AttentionMetadata,
                 logits_to_keep: torch.Tensor) -> torch.Tensor | None:
        keep = logits_to_keep if self.group.is_driver else logits_to_keep[:0]
        out = self.model(input_ids=input_ids, position_ids=position_ids, attn_metadata=meta, logits_to_keep=keep,
                         use_cache=False)
        return out.logits if self.group.is_driver else None


def tensor_shard_forward(model: nn.Module, group: ShardGroup) -> DirectForward | TransformersShardForward:
    """The forward of a tensor shard's part: the direct forward where it runs the family,
    else transformers' with the sums hooked in."""
    if unsupported_reason(model) is None:
        return DirectForward(model, group)
    return TransformersShardForward(model, group)
