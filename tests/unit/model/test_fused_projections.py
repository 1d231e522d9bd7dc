"""Sibling projections run as one multiply (workers/model/fused_projections.py): the same numbers
as the separate linears whatever the call order, inside transformers' own models, through
the engine, with CPU packing on top, and through the loader."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.engines import make_engine, run_to_completion
from tests.unit.model.test_model_families import (
    assert_same,
    engine_outputs,
    gemma2,
    mistral,
    prompts,
    reference,
)
from workers.contract.sampling_params import SamplingParams
from workers.model import loader as model_loader
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import PackedLinear, pack_linear_layers
from workers.model.fused_projections import (
    FusedProjection,
    ProjectionSlice,
    fuse_sibling_projections,
)


def _attention(bias: bool) -> nn.Module:
    torch.manual_seed(0)
    parent = nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = (nn.Linear(32, 48, bias=bias), nn.Linear(32, 16, bias=bias),
                                                   nn.Linear(32, 16, bias=bias))
    return parent


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 32), (5, 32), (2, 7, 32)])
def test_fused_siblings_equal_the_separate_linears(bias, shape):
    separate = _attention(bias)
    fused = copy.deepcopy(separate)
    assert fuse_sibling_projections(fused) == 1
    x = torch.randn(shape)
    with torch.inference_mode():
        for name in ("q_proj", "k_proj", "v_proj"):
            expected, got = getattr(separate, name)(x), getattr(fused, name)(x)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
            # What model code reads off a linear still reads right.
            slice_ = getattr(fused, name)
            assert torch.equal(slice_.weight, getattr(separate, name).weight)
            assert slice_.out_features == expected.shape[-1] and slice_.in_features == 32
            assert (slice_.bias is None) == (not bias)


def test_any_call_order_and_input_gives_the_right_columns():
    separate = _attention(bias=True)
    fused = copy.deepcopy(separate)
    fuse_sibling_projections(fused)
    x, y = torch.randn(3, 32), torch.randn(3, 32)

    def check(name, inp):
        torch.testing.assert_close(getattr(fused, name)(inp), getattr(separate, name)(inp), rtol=1e-5, atol=1e-6)

    with torch.inference_mode():
        check("v_proj", x)  # the last sibling first
        check("q_proj", x)
        check("q_proj", x)  # twice in a row: computed anew, not another sibling's columns
        check("k_proj", y)  # another input (cross-attention style)
        check("v_proj", y)
        check("q_proj", x)
        check("k_proj", x)
        check("v_proj", x)


@pytest.mark.parametrize("release", ["last-sibling-called", "input-freed"])
def test_the_product_is_released(release):
    """Held until every sibling took its columns, or until the input is freed: a layer that
    never calls v_proj (K/V shared from another layer) keeps neither past that layer."""
    fused = _attention(bias=False)
    fuse_sibling_projections(fused)
    group = fused.q_proj.fused
    x = torch.randn(2, 32)
    fused.q_proj(x)
    fused.k_proj(x)
    assert group._input() is x and group._product is not None
    if release == "last-sibling-called":
        fused.v_proj(x)
    else:
        del x
    assert group._input is None and group._product is None


def test_groups_that_cannot_be_one_multiply_stay_separate():
    mixed_width = _attention(bias=False)
    mixed_width.k_proj = nn.Linear(16, 16, bias=False)  # reads another input width
    mixed_bias = _attention(bias=False)
    mixed_bias.v_proj = nn.Linear(32, 16, bias=True)
    incomplete = _attention(bias=False)
    del incomplete.v_proj

    class Custom(nn.Linear):
        pass

    subclass = _attention(bias=False)
    subclass.q_proj = Custom(32, 48)
    for module in (mixed_width, mixed_bias, incomplete, subclass):
        assert fuse_sibling_projections(module) == 0
        assert not any(isinstance(m, ProjectionSlice) for m in module.modules())


def test_a_fused_llama_keeps_its_parameters_and_logits(tiny_model):
    model = copy.deepcopy(tiny_model)
    layers = model.config.num_hidden_layers
    params = sum(p.numel() for p in tiny_model.parameters())
    assert fuse_sibling_projections(model) == 2 * layers  # attention and MLP of every layer
    assert sum(p.numel() for p in model.parameters()) == params  # each stacked weight registered once
    assert sum(isinstance(m, FusedProjection) for m in model.modules()) == 2 * layers
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, tiny_model(ids).logits, rtol=1e-5, atol=1e-5)


def test_engine_greedy_output_is_the_same_fused(tiny_model, paged_attn_name):
    plain = copy.deepcopy(tiny_model)
    plain.set_attn_implementation(paged_attn_name)
    fused = copy.deepcopy(plain)
    fuse_sibling_projections(fused)
    prompts_ = [[5, 9, 13, 2, 7, 11, 3], [4, 4, 8], list(range(3, 40))]
    outputs = []
    for model in (plain, fused):
        engine = make_engine(model, max_num_batched_tokens=16)  # chunked prefill mixed with decodes
        ids = [engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0))
               for p in prompts_]
        events = run_to_completion(engine)
        outputs.append([[(e.token_id, e.logprob) for e in events[i]] for i in ids])
    for got, expected in zip(outputs[1], outputs[0]):
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, expected)) < 1e-4


@pytest.mark.parametrize("build", [mistral, gemma2], ids=["mistral", "gemma2"])
def test_fused_model_families_match_transformers_eager(build):
    """Mistral and Gemma 2 (its MLP gates with GELU, its attention soft-caps) fused and
    paged, against the unfused model's eager generate."""
    model = build()
    paged = copy.deepcopy(model)
    assert fuse_sibling_projections(paged) == 2 * model.config.num_hidden_layers
    paged.set_attn_implementation(register_paged_attention())
    batch, max_tokens = prompts(), [12, 14, 9, 10]
    got = engine_outputs(make_engine(paged, num_blocks=64, max_num_batched_tokens=5), batch, max_tokens)
    for tokens, prompt, n in zip(got, batch, max_tokens):
        assert_same(tokens, reference(model, prompt, n))


def test_packing_takes_the_stacked_weights(tiny_model):
    """CPU packing after fusion packs each stacked weight once (the slices hold no weight
    of their own), and the logits stay float32's."""
    model = copy.deepcopy(tiny_model)
    layers = model.config.num_hidden_layers
    fuse_sibling_projections(model)
    assert pack_linear_layers(model, float32=True) == 4 * layers + 1  # qkv, o, gate/up, down + the LM head
    assert all(isinstance(m.fused.linear, PackedLinear) for m in model.modules() if isinstance(m, ProjectionSlice))
    assert model.model.layers[0].self_attn.k_proj.weight.is_meta  # shape and dtype still readable
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, tiny_model(ids).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fuse", [True, False])
def test_the_loader_fuses_unless_told_not_to(tiny_model_dir, fuse):
    loaded = model_loader.load_model(str(tiny_model_dir), "cpu", "float32", pack_cpu_weights=False,
                                     fuse_projections=fuse)
    groups = sum(isinstance(m, FusedProjection) for m in loaded.model.modules())
    assert groups == (2 * loaded.model.config.num_hidden_layers if fuse else 0)
