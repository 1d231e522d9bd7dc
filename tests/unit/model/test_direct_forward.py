"""The direct forward of Llama-shaped models (workers/model/direct_forward.py): the same
logits as transformers' forward over the paged cache, bit for bit, through the engine's
chunked prefills, prefix-cache hits and decodes; and the models it must leave alone."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from tests.support.engines import make_engine
from tests.unit.model.test_model_families import (
    SHAPE,
    WINDOW,
    _init,
    engine_outputs,
    gemma2,
    mistral,
    prompts,
)
from workers.core.limits import LoraLimits
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import pack_linear_layers
from workers.model.direct_forward import DirectForward, unsupported_reason
from workers.model.fused_projections import fuse_sibling_projections


def _with_vectors(model):
    """test_model_families' weights, and its norm weights and biases drawn away from 1 and
    0, so Qwen2's biases and Qwen3's head norms change the logits."""
    model = _init(model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    return model


def llama():
    return _with_vectors(LlamaForCausalLM(LlamaConfig(**SHAPE)))


def llama3_rope():
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}
    return _with_vectors(LlamaForCausalLM(LlamaConfig(**SHAPE, rope_parameters=rope)))


def qwen2_sliding_bias():
    # Qwen2's q/k/v carry biases; its later layer slides (max_window_layers=1).
    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    assert config.layer_types == ["full_attention", "sliding_attention"]
    return _with_vectors(Qwen2ForCausalLM(config))


def qwen3_head_norms():
    # Qwen3 norms each q and k head before the rotation.
    config = Qwen3Config(**SHAPE, head_dim=16, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return _with_vectors(Qwen3ForCausalLM(config))


def prepared(model, pack: bool):
    model = copy.deepcopy(model)
    fuse_sibling_projections(model)
    if pack:
        pack_linear_layers(model, float32=True)
    model.set_attn_implementation(register_paged_attention())
    return model


def run(model, direct: bool, budget: int) -> tuple[list[list[tuple[int, float]]], list[torch.Tensor]]:
    """Each request's (token, logprob) and every step's logits: the first request alone
    first (so the third hits its prefix in the cache), then the rest together."""
    engine = make_engine(model, num_blocks=64, max_num_batched_tokens=budget, direct_forward=direct)
    assert (engine.runner.direct is not None) == direct
    forward = engine.runner.forward
    logits: list[torch.Tensor] = []

    def recording(*args, **kwargs):
        out, rows, pooled = forward(*args, **kwargs)
        logits.append(out.clone())
        return out, rows, pooled

    engine.runner.forward = recording
    batch, max_tokens = prompts(), [12, 14, 9, 10]
    outputs = engine_outputs(engine, batch[:1], max_tokens[:1]) + engine_outputs(engine, batch[1:], max_tokens[1:])
    assert engine.blocks.hit_tokens > 0
    return outputs, logits


@pytest.mark.parametrize("build", [llama, llama3_rope, mistral, qwen2_sliding_bias, qwen3_head_norms],
                         ids=["llama", "llama3-rope", "mistral-sliding-window", "qwen2-bias-sliding-layer",
                              "qwen3-head-norms"])
@pytest.mark.parametrize("pack", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("budget", [64, 5], ids=["whole-prompts", "chunked-prefill"])
def test_direct_forward_gives_transformers_logits_bit_for_bit(build, pack, budget):
    model = prepared(build(), pack)
    want, want_logits = run(model, direct=False, budget=budget)
    got, got_logits = run(model, direct=True, budget=budget)
    assert got == want
    assert len(got_logits) == len(want_logits)
    for step, (a, b) in enumerate(zip(got_logits, want_logits)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max().item()}"


def test_the_check_can_fail():
    """The same comparison against a model whose window differs, and one without Qwen3's
    head norms: the logits move, so the test above would catch a direct forward that
    dropped either."""
    model = prepared(mistral(), pack=False)
    wide = copy.deepcopy(model)
    wide.config.sliding_window = 10**6
    _, direct_logits = run(model, direct=True, budget=64)
    _, wide_logits = run(wide, direct=False, budget=64)
    assert any(not torch.equal(a, b) for a, b in zip(direct_logits, wide_logits))
    qwen3 = prepared(qwen3_head_norms(), pack=False)
    _, with_norms = run(qwen3, direct=True, budget=64)
    for layer in qwen3.model.layers:
        layer.self_attn.q_norm.weight.data.fill_(1.0)
        layer.self_attn.k_norm.weight.data.fill_(1.0)
    _, unit_norms = run(qwen3, direct=False, budget=64)
    assert any(not torch.equal(a, b) for a, b in zip(with_norms, unit_norms))


def test_bfloat16_norms_run_the_models_own_rounding():
    model = prepared(llama(), pack=False).to(torch.bfloat16)
    want, _ = run(model, direct=False, budget=64)
    got, _ = run(model, direct=True, budget=64)
    assert got == want


def test_models_it_was_not_written_for_keep_transformers_forward():
    assert "not a Llama-shaped family" in unsupported_reason(prepared(gemma2(), pack=False))
    unfused = llama()
    assert "not fused" in unsupported_reason(unfused)
    no_head_norms = prepared(qwen3_head_norms(), pack=False)
    for layer in no_head_norms.model.layers:
        del layer.self_attn.q_norm
    assert "lacks per-head q/k norms" in unsupported_reason(no_head_norms)
    with pytest.raises(ValueError, match="not fused"):
        DirectForward(unfused)
    engine = make_engine(prepared(gemma2(), pack=False), num_blocks=64)
    assert engine.runner.direct is None


def test_off_by_config_and_on_with_lora():
    model = prepared(llama(), pack=False)
    assert make_engine(model, num_blocks=64).runner.direct is not None
    assert make_engine(model, num_blocks=64, direct_forward=False).runner.direct is None
    # LoRA layers wrap the projections in place (a model of its own); the forward calls them.
    lora_model = prepared(llama(), pack=False)
    assert make_engine(lora_model, num_blocks=64, lora=LoraLimits(max_loras=1, max_rank=4)).runner.direct is not None
