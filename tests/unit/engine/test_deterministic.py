"""`engine.deterministic` on the tiny model, float32 and bfloat16: a request's tokens and
their log-probabilities are bit for bit the same alone, among many neighbours, with its
prompt chunked otherwise, after a prefix-cache hit, and with speculative verification;
RowSliced layers give a row one-row sums; and without the mode the same comparison moves."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.support.engines import make_engine, prompt_ids, run_to_completion
from tests.support.tiny_models import build_tiny_llama
from workers.contract.model_config import ModelConfig
from workers.contract.sampling_params import SamplingParams
from workers.core.limits import SpeculativeLimits
from workers.model.batch_invariant import (
    SLICE_CANDIDATES,
    RowSliced,
    invariant_rows,
    make_batch_invariant,
)
from workers.model.cpu_linear import (
    PackedLinear,
    onednn_bf16_available,
    pack_linear_layers,
)
from workers.model.fused_projections import fuse_sibling_projections

TARGET_TOKENS = 16


@pytest.fixture(scope="module")
def wide_model(tiny_tokenizer):
    """The default model's widths (576 hidden, 1536 MLP) in 2 layers: oneDNN's bfloat16
    kernels block these by batch size (the 64-wide tiny model they do not)."""
    return build_tiny_llama(len(tiny_tokenizer), hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                            num_key_value_heads=3)


@pytest.fixture(params=["float32-direct", "bfloat16-direct", "float32-transformers", "bfloat16-transformers"])
def model(request, wide_model, paged_attn_name):
    """A builder of fresh copies (the mode wraps a model's layers in place), run by the
    direct forward (projections fused, as the loader does) or transformers' modules."""
    dtype, forward = request.param.split("-")
    if dtype == "bfloat16" and not onednn_bf16_available():
        pytest.skip("no oneDNN bfloat16 on this CPU")

    def fresh() -> nn.Module:
        model = copy.deepcopy(wide_model).to(getattr(torch, dtype))
        model.set_attn_implementation(paged_attn_name)
        if forward == "direct":
            fuse_sibling_projections(model)
        pack_linear_layers(model, float32=False)  # as the loader packs bfloat16 (float32: MKL's, torch's own)
        model.expects_direct_forward = forward == "direct"
        return model

    return fresh


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer) -> list[list[int]]:
    base = prompt_ids(tiny_tokenizer)
    return [(p * 6)[: 20 + 7 * i] for i, p in enumerate(base * 8)]  # 40 prompts, 20 to 293 tokens


def target_run(model, prompts, deterministic: bool, neighbours: int, budget: int = 512, cache_hit: bool = False,
               **limits) -> list[tuple[int, float]]:
    """The first prompt's greedy tokens and their logprobs, run with `neighbours` others."""
    model = model()
    engine = make_engine(model, num_blocks=1200, block_size=4, max_num_batched_tokens=budget,
                         max_num_seqs=64, deterministic=deterministic, enable_prefix_caching=cache_hit, **limits)
    assert (engine.runner.direct is not None) == model.expects_direct_forward  # the mode's layers keep it
    params = SamplingParams(max_tokens=TARGET_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    if cache_hit:
        engine.add_request(prompts[0], params)
        run_to_completion(engine)
    others = [engine.add_request(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
              for p in prompts[1 : 1 + neighbours]]
    target = engine.add_request(prompts[0], params)
    events = run_to_completion(engine)
    assert all(len(events[o]) == 24 for o in others)
    return [(e.token_id, e.logprob) for e in events[target]]


def test_a_request_computes_the_same_whatever_runs_beside_it(model, prompts):
    alone = target_run(model, prompts, True, neighbours=0)
    assert len(alone) == TARGET_TOKENS
    assert target_run(model, prompts, True, neighbours=39) == alone
    assert target_run(model, prompts, True, neighbours=12, budget=37) == alone  # chunked otherwise
    assert target_run(model, prompts, True, neighbours=5, cache_hit=True) == alone
    spec = SpeculativeLimits(num_tokens=3, lookup_min=1, lookup_max=3, disable_by_batch_size=None)
    assert target_run(model, prompts, True, neighbours=3, speculative=spec) == alone


def test_without_the_mode_the_neighbours_move_the_logprobs(model, prompts):
    """The check above can fail: the plain engine's bfloat16 and MKL float32 sums depend on the batch."""
    alone = target_run(model, prompts, False, neighbours=0)
    crowded = [target_run(model, prompts, False, neighbours=39), target_run(model, prompts, False, neighbours=12,
                                                                              budget=37)]
    assert any(run != alone for run in crowded)


def test_row_slices_give_one_row_sums():
    layer = nn.Linear(48, 80)
    rows = invariant_rows(layer, torch.float32)
    sliced = RowSliced(layer, 1)
    x = torch.randn(70, 48)
    with torch.inference_mode():
        singles = torch.cat([layer(x[i : i + 1]) for i in range(70)])
        assert torch.equal(sliced(x), singles) and torch.equal(sliced(x.view(7, 10, 48)), singles.view(7, 10, 80))
    assert rows in (64, 32, 8, 1)


def test_a_layer_is_probed_once():
    """A second engine on the same loaded model reuses the answer (the probe of a big
    head takes seconds)."""
    layer, calls = nn.Linear(8, 4), []
    layer.register_forward_hook(lambda *_: calls.append(1))
    first = invariant_rows(layer, torch.float32)
    probed = len(calls)
    assert probed > 64 and invariant_rows(layer, torch.float32) == first and len(calls) == probed
    assert invariant_rows(nn.Linear(8, 4), torch.float32) in SLICE_CANDIDATES and len(calls) == probed


def test_every_linear_is_wrapped_once():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4)))
    assert make_batch_invariant(model) == 2 and make_batch_invariant(model) == 0
    wrapped = [m for m in model.modules() if isinstance(m, RowSliced)]
    assert len(wrapped) == 2 and all(isinstance(m.layer, (PackedLinear, nn.Linear)) for m in wrapped)


@pytest.mark.parametrize(("extra", "words"), [
    ({"device": "cuda", "deployment": {"ray_actor_options": {"num_gpus": 1}}}, "device: cuda"),
    ({"lora": {"adapters": {}}}, "lora"),
    ({"parallel": {"tensor_parallel_size": 2}}, "parallel.tensor_parallel_size"),
])
def test_the_config_refuses_what_the_mode_does_not_cover(extra, words):
    with pytest.raises(ValueError, match="engine.deterministic"):
        ModelConfig.model_validate({"id": "m", "engine": {"deterministic": True}, **extra})
    ModelConfig.model_validate({"id": "m", "engine": {"deterministic": True}})


def test_a_quantized_models_fused_layers_keep_the_mode(tmp_path, prompts, paged_attn_name):
    """A GGUF Llama with 8-bit activations: its layers run fused (norms, SiLU and residual
    adds inside the products, rotation and cache write in C), each row on its own, so the
    mode's guarantee holds for them as for float layers."""
    from tests.unit.model.test_quantized_weights import Q, _twin_pair
    from workers.model.gguf_packing import keep_gguf_weights_packed

    _, quantized = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    keep_gguf_weights_packed(quantized, tmp_path / "m.gguf", activations="int8x2")
    quantized.set_attn_implementation(paged_attn_name)
    quantized.expects_direct_forward = True
    engine = make_engine(copy.deepcopy(quantized), deterministic=True)
    assert all(layer.fused is not None for layer in engine.runner.direct.layers)
    vocab_prompts = [[t % 96 for t in p] for p in prompts]  # the GGUF model's vocabulary is 96 tokens

    def fresh() -> nn.Module:
        return copy.deepcopy(quantized)

    alone = target_run(fresh, vocab_prompts, True, neighbours=0)
    assert target_run(fresh, vocab_prompts, True, neighbours=39) == alone
    assert target_run(fresh, vocab_prompts, True, neighbours=12, budget=37) == alone
    assert target_run(fresh, vocab_prompts, True, neighbours=5, cache_hit=True) == alone


def test_unset_the_mode_is_on_only_where_it_costs_nothing(tmp_path, paged_attn_name):
    """`deterministic: null`: on for a CPU model whose linears all keep quantized blocks with
    8-bit activations (no slices: the fused layers stay whole); off for its float twin, for
    float32 activations (dequantized products), and with LoRA slots."""
    from tests.unit.model.test_quantized_weights import Q, _twin_pair
    from workers.core.limits import LoraLimits
    from workers.model.gguf_packing import keep_gguf_weights_packed

    float_twin, quantized = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    exact = copy.deepcopy(quantized)
    keep_gguf_weights_packed(quantized, tmp_path / "m.gguf", activations="int8x2")
    keep_gguf_weights_packed(exact, tmp_path / "m.gguf", activations="float32")
    for model in (float_twin, quantized, exact):
        model.set_attn_implementation(paged_attn_name)

    def mode(model, **limits) -> bool:
        engine = make_engine(copy.deepcopy(model), deterministic=None, **limits)
        assert engine.describe().deterministic == engine.limits.deterministic
        return engine.limits.deterministic

    assert mode(quantized) is True
    assert not any(isinstance(m, RowSliced) for m in make_engine(copy.deepcopy(quantized), deterministic=None)
                   .runner.model.modules())
    assert mode(float_twin) is False and mode(exact) is False
    assert mode(quantized, lora=LoraLimits(2, 8)) is False
