"""CPU models with oneDNN-packed linear weights (workers/model/cpu_linear.py: bfloat16 always,
float32 where the load-time probe finds it faster), and the dtype `auto` picks
(workers/model/loader.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.engines import make_engine, run_to_completion
from workers.contract.sampling_params import SamplingParams
from workers.model import cpu_linear
from workers.model import loader as model_loader
from workers.model.cpu_linear import (
    PackedLinear,
    onednn_bf16_available,
    pack_linear_layers,
)

needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(), reason="this CPU has no oneDNN bfloat16 kernels")


@needs_onednn_bf16
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 64), (7, 64), (1, 5, 64), (3, 9, 64)])
def test_packed_linear_equals_plain_bfloat16_linear(shape, bias):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96, bias=bias).to(torch.bfloat16)
    x = torch.randn(shape, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    packed = PackedLinear(linear)
    got = packed(x)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # Both accumulate in float32 and round once: at most one bfloat16 step apart.
    assert torch.allclose(got.float(), expected.float(), rtol=2**-7, atol=1e-2)
    assert packed.weight.shape == linear.weight.shape and packed.weight.is_meta
    # A non-contiguous input (a transposed view) gives the same numbers.
    xt = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert torch.equal(packed(xt), got)


@needs_onednn_bf16
def test_packing_a_bfloat16_model_keeps_its_logits(tiny_model):
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    with torch.inference_mode():
        before = model(ids).logits
    assert pack_linear_layers(model) == linears > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert model.get_output_embeddings().weight.shape[0] == before.shape[-1]
    with torch.inference_mode():
        after = model(ids).logits
    assert torch.allclose(after.float(), before.float(), rtol=2**-6, atol=2e-2)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_float32_packing_is_off_when_asked(tiny_model):
    model = copy.deepcopy(tiny_model)
    assert pack_linear_layers(model, float32=False) == 0
    assert not any(isinstance(m, PackedLinear) for m in model.modules())


@pytest.mark.parametrize("shape", [(1, 64), (32, 64), (2, 5, 64)])
def test_packed_float32_linear_equals_plain(shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(shape)
    expected = torch.nn.functional.linear(x, linear.weight, linear.bias)
    got = PackedLinear(linear)(x)
    assert got.dtype == torch.float32 and got.shape == expected.shape
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_packing_a_float32_model_keeps_its_logits(tiny_model):
    model = copy.deepcopy(tiny_model)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    with torch.inference_mode():
        before = model(ids).logits
        assert pack_linear_layers(model, float32=True) == linears > 0
        after = model(ids).logits
    assert torch.allclose(after, before, rtol=1e-4, atol=1e-5)
    assert torch.equal(after.argmax(-1), before.argmax(-1))


def test_packed_weights_count_in_the_models_weight_bytes(tiny_model):
    """A draft's price per step is its weight bytes over its target's: a target whose
    linears the probe packed (and a draft it did not) must weigh what it weighs unpacked."""
    model = copy.deepcopy(tiny_model)
    assert not model.config.tie_word_embeddings  # (a tied head packed is a second copy)
    before = model_loader.weight_bytes(model)
    assert pack_linear_layers(model, float32=True) > 0
    assert model_loader.weight_bytes(model) == before


@pytest.mark.parametrize(("plain_ms", "packed_ms", "packs"), [(7.0, 5.5, True), (7.0, 6.8, False), (0.3, 0.8, False)])
def test_float32_packing_follows_the_probe(tiny_model, monkeypatch, plain_ms, packed_ms, packs):
    """Unasked (`float32=None`), a float32 model is packed only when the probe finds oneDNN
    at least PACKED_FLOAT32_MIN_SPEEDUP faster; the probe sees the first layers, not the LM head."""
    probed = []

    def probe(linears):
        probed.extend(linears)
        return plain_ms, packed_ms

    monkeypatch.setattr(cpu_linear, "probe_float32_packing", probe)
    model = copy.deepcopy(tiny_model)
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == (linears if packs else 0)
    assert 0 < len(probed) <= cpu_linear.PROBE_LAYERS and tiny_model.lm_head not in probed
    assert all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in probed)


def test_the_probe_times_both_layouts(tiny_model):
    linears = [m for m in tiny_model.modules() if type(m) is torch.nn.Linear][:3]
    plain_ms, packed_ms = cpu_linear.probe_float32_packing(linears)
    assert plain_ms > 0 and packed_ms > 0
    assert all(type(m) is torch.nn.Linear and not m.weight.is_meta for m in linears)  # the model is untouched


@needs_onednn_bf16
def test_layers_kept_in_another_dtype_are_not_packed(tiny_model):
    """A bfloat16 model that keeps its LM head in float32 (as some checkpoints keep layers
    out of the main dtype) gets every layer packed but that one, and still runs."""
    model = copy.deepcopy(tiny_model).to(torch.bfloat16)
    model.lm_head.float()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert pack_linear_layers(model) == linears - 1
    assert type(model.lm_head) is torch.nn.Linear
    hidden = model.model(torch.tensor([[5, 9, 13]])).last_hidden_state
    assert model.lm_head(hidden.float()).dtype == torch.float32


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_onednn_bf16), torch.float32])
def test_engine_output_is_the_same_packed_or_not(tiny_model, paged_attn_name, dtype):
    """Greedy engine output, batched with chunked prefill, is identical with packed and with
    plain weights."""
    plain = copy.deepcopy(tiny_model).to(dtype)
    plain.set_attn_implementation(paged_attn_name)
    packed = copy.deepcopy(plain)
    assert pack_linear_layers(packed, float32=True) > 0
    outputs = []
    for model in (plain, packed):
        engine = make_engine(model, max_num_batched_tokens=16)
        for i in range(4):
            engine.add_request(list(range(3 + i, 30 + 3 * i)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
        events = run_to_completion(engine)
        outputs.append({rid: [e.token_id for e in evs] for rid, evs in events.items()})
        assert engine.blocks.num_used_blocks == 0
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[0].values())


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_on_cpu_follows_the_matrix_unit(monkeypatch, native, expected):
    monkeypatch.setattr(model_loader, "has_native_bf16_matmul", lambda: native)
    assert model_loader.resolve_dtype("auto", "cpu") == expected
    # Weights kept in quantized blocks: the kernels take float32 whatever the CPU.
    assert model_loader.resolve_dtype("auto", "cpu", quantized=True) == torch.float32
    assert model_loader.resolve_dtype("bfloat16", "cpu", quantized=True) == torch.bfloat16
    assert model_loader.resolve_dtype("float32", "cpu") == torch.float32
    assert model_loader.resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert model_loader.resolve_dtype("auto", "cuda") == "auto"


@pytest.mark.parametrize(("dtype", "pack", "float32_pays"),
                         [("float32", True, False), ("float32", True, True), ("float32", False, True),
                          ("bfloat16", True, False), ("bfloat16", False, False)])
def test_worker_reports_its_dtype_and_packing(tiny_model_dir, monkeypatch, dtype, pack, float32_pays):
    """The deployment's path: model config -> loader -> packing; `info()` says what runs, and
    the worker's request path gets the configured stream interval."""
    import asyncio

    from workers.serving.deployment import ModelWorker

    if dtype == "bfloat16" and pack and not onednn_bf16_available():
        pytest.skip("this CPU has no oneDNN bfloat16 kernels")
    monkeypatch.setattr(cpu_linear, "float32_packing_pays", lambda model: float32_pays)
    config = {"id": "tiny", "source": str(tiny_model_dir), "dtype": dtype, "pack_cpu_weights": pack,
              "engine": {"kv_cache_memory_gib": 0.001, "torch_threads": 1, "stream_interval": 3}}

    async def body():
        worker = ModelWorker.func_or_class(config)
        try:
            assert not worker.engine.limits.async_scheduling  # nothing to overlap on a CPU
            return worker.info(), worker.processor.stream_interval
        finally:
            worker.engine.stop()

    info, interval = asyncio.run(body())
    assert info.dtype == dtype and interval == 3
    # The tiny Llama, its projections fused by default: 2 layers x (q/k/v, o, gate/up, down) + the LM head.
    linears = 2 * 4 + 1
    packs = pack and (dtype == "bfloat16" or float32_pays)
    assert info.packed_linear_layers == (linears if packs else 0)
    assert info.fused_projections == 2 * 2
    assert info.decode_attention == "cpu" and info.cuda_graph_max_batch == 0  # a CPU worker (the C kernel)
