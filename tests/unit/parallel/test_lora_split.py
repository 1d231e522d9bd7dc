"""A LoRA adapter cut for a tensor shard (workers/parallel/lora_split.py): the shards'
deltas of a column-split layer are the whole delta's columns, those of a row-split layer
add up to the whole delta; an adapter of another model's sizes is refused by name."""

from __future__ import annotations

import pytest
import torch

from workers.contract.lora import LoraAdapterError, LoraRequest
from workers.contract.model_shape import SplitShape
from workers.lora.peft_files import LoraAdapter, LoraModule
from workers.parallel.lora_split import cut_adapter
from workers.parallel.shard_group import TensorRank
from workers.parallel.tensor_split import cut_for

SHAPE = SplitShape(heads=4, kv_heads=2, head_dim=8, intermediate=48, vocab=100)
HIDDEN = 32
Q, O = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.o_proj"


def adapter(q_out: int = 32) -> LoraAdapter:
    torch.manual_seed(0)
    modules = {Q: LoraModule(torch.randn(4, HIDDEN), torch.randn(q_out, 4)),
               O: LoraModule(torch.randn(4, 32), torch.randn(HIDDEN, 4))}
    return LoraAdapter(LoraRequest.of("a", "/a"), modules)


def test_the_shards_deltas_make_the_whole_delta():
    whole, x = adapter(), torch.randn(3, HIDDEN)
    attn_in = torch.randn(3, 32)  # o_proj's input: every head's output
    parts = [cut_adapter(whole, SHAPE, TensorRank(rank, 2)) for rank in range(2)]
    q = torch.cat([x @ p.modules[Q].a.t() @ p.modules[Q].b.t() for p in parts], dim=-1)
    assert torch.allclose(q, x @ whole.modules[Q].a.t() @ whole.modules[Q].b.t(), atol=1e-5)
    o = sum(attn_in.narrow(1, *_span(O, rank)) @ p.modules[O].a.t() @ p.modules[O].b.t()
            for rank, p in enumerate(parts))
    assert torch.allclose(o, attn_in @ whole.modules[O].a.t() @ whole.modules[O].b.t(), atol=1e-4)


def test_an_adapter_of_other_sizes_is_refused_by_name():
    with pytest.raises(LoraAdapterError, match=r"'a': 'model.layers.0.self_attn.q_proj' has 40 output features, "
                       r"the model's layer 32"):
        cut_adapter(adapter(q_out=40), SHAPE, TensorRank(0, 2))


def _span(name: str, rank: int) -> tuple[int, int]:
    cut = cut_for(name + ".weight", SHAPE, TensorRank(rank, 2))
    return cut.start, cut.end - cut.start


def test_a_stage_knows_the_parts_shapes_of_the_layers_it_does_not_hold():
    from transformers import LlamaConfig

    from workers.parallel.lora_split import AdapterCut
    from workers.parallel.pipeline import StageLayers

    config = LlamaConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=100)
    first = AdapterCut(config, TensorRank(1, 2), StageLayers.of(0, 2, 4))
    assert first.holds("model.layers.1.self_attn.q_proj") and not first.holds("model.layers.2.self_attn.q_proj")
    assert first.expected("model.layers.3.self_attn.q_proj") == (16, 32)  # 2 of 4 heads of 8
    assert first.expected("model.layers.3.self_attn.k_proj") == (8, 32)
    assert first.expected("model.layers.3.self_attn.o_proj") == (32, 16)
    assert first.expected("model.layers.3.mlp.down_proj") == (32, 24)
    assert first.expected("model.layers.4.mlp.down_proj") is None  # no such layer
    assert first.expected("model.layers.3.mlp.act_fn") is None
