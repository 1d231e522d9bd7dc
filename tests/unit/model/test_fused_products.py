"""The quantized products with a layer's small operators inside them (cpu_kernels.c's
prologues and residual add; QuantizedLinear.fused; the direct forward's fused layers):
each computes what the separate operators compute, row by row whatever the batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.support.engines import make_engine, run_to_completion
from tests.unit.model.test_quantized_weights import (
    FORMATS,
    PROMPTS,
    Q,
    _packed,
    _portable_kernels,
    _relative_error,
    _twin_pair,
)
from workers.contract.sampling_params import SamplingParams
from workers.model.gguf_packing import keep_gguf_weights_packed
from workers.quant.native_kernels import (
    PROLOGUE_NONE,
    PROLOGUE_RMS_NORM,
    PROLOGUE_SILU_GATE,
    kernels,
)
from workers.quant.quantized_layers import QuantizedLinear

# How far one rounding of the activations moves the product when its input moves by an
# ulp (a value on a rounding boundary goes the other way): two levels stay float-like.
BOUNDS = {"int8": 2e-3, "int8x2": 2e-5}


def _layer(fmt, rows: int, cols: int, activations: str, seed: int = 0) -> QuantizedLinear:
    packed, _ = _packed(fmt, rows, cols, seed=seed)
    return QuantizedLinear(packed, kernels(), None, torch.float32, activations)


def _inputs(rows: int, cols: int, seed: int) -> torch.Tensor:
    return 3 * torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_fused_norm_is_the_norm_then_the_product(fmt, activations):
    layer = _layer(fmt, 64, 256, activations)
    x, weight = _inputs(9, 256, 1), torch.rand(256, generator=torch.Generator().manual_seed(2)) + 0.5
    want = layer(F.rms_norm(x, (256,), weight, 1e-5))
    got = layer.fused(x, PROLOGUE_RMS_NORM, weight, 1e-5)
    assert _relative_error(got, want) < BOUNDS[activations]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_fused_gate_is_silu_times_up_then_the_product(fmt, activations):
    """Rows of gate then up (2 x 256); gates far out on both sides (the sigmoid's e^-|g|)."""
    layer = _layer(fmt, 64, 256, activations)
    gate_up = _inputs(9, 512, 3)
    gate_up[0, :8] = torch.tensor([-100.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 100.0, 88.0])
    want = layer(F.silu(gate_up[:, :256]) * gate_up[:, 256:])
    assert _relative_error(layer.fused(gate_up, PROLOGUE_SILU_GATE), want) < BOUNDS[activations]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_the_residual_add_is_the_same_bits_as_adding_after(fmt, activations):
    layer = _layer(fmt, 64, 256, activations)
    x, residual = _inputs(7, 256, 4), _inputs(7, 64, 5)
    want = residual + layer(x)
    got = layer.fused(x, residual=residual)
    assert got is residual and torch.equal(got, want)


@pytest.mark.parametrize("prologue", [PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_GATE])
def test_a_fused_rows_result_does_not_depend_on_its_batch(prologue):
    """70 rows (several rounding tasks of 16 rows, panels, 4-row tiles) against each alone,
    accumulating into a residual too."""
    layer = _layer(Q.Q4_1, 64, 256, "int8x2")
    width = 512 if prologue == PROLOGUE_SILU_GATE else 256
    x, weight, residual = _inputs(70, width, 6), torch.rand(256) + 0.5, _inputs(70, 64, 7)
    batch = layer.fused(x, prologue, weight, 1e-6, residual=residual.clone())
    alone = torch.cat([layer.fused(x[i:i + 1], prologue, weight, 1e-6, residual=residual[i:i + 1].clone())
                       for i in range(70)])
    assert torch.equal(batch, alone)


def test_the_portable_build_fuses_as_the_native_one_does(tmp_path):
    portable, native = _portable_kernels(tmp_path), kernels()
    layer = _layer(Q.Q4_1, 64, 256, "int8x2")
    x, gate_up, weight = _inputs(5, 256, 8), _inputs(5, 512, 9), torch.rand(256) + 0.5
    for inputs, prologue in ((x, PROLOGUE_RMS_NORM), (gate_up, PROLOGUE_SILU_GATE)):
        got, want = (k.fused_interleaved_matmul(layer.fmt, layer.blocks, 256, inputs, torch.empty(5, 64), 2,
                                                prologue, weight, 1e-5) for k in (portable, native))
        assert _relative_error(got, want) < 1e-5


def test_a_quantized_models_layers_run_fused_and_give_the_unfused_tokens(tmp_path):
    """A tiny GGUF Llama with 8-bit activations: every layer and the head fused in the
    direct forward; 16 prompts' greedy tokens (batches mixing one-row and many-row steps)
    equal the same engine's with the fusion off, logprobs within the activations' rounding."""
    _, model = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf", activations="int8x2")

    def greedy(fused: bool) -> tuple[list[list[int]], list[float]]:
        engine = make_engine(model)
        direct = engine.runner.direct
        assert all(layer.fused is not None for layer in direct.layers) and direct.fused_head is not None
        if not fused:
            direct.layers = [dataclasses.replace(layer, fused=None) for layer in direct.layers]
            direct.fused_head = direct.decode_layers = None
        ids = [engine.add_request(prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                         logprobs=0))
               for prompt in PROMPTS]
        events = run_to_completion(engine)
        return ([[ev.token_id for ev in events[i]] for i in ids], [ev.logprob for i in ids for ev in events[i]])

    (fused_tokens, fused_logprobs), (plain_tokens, plain_logprobs) = greedy(True), greedy(False)
    assert fused_tokens == plain_tokens
    assert _relative_error(torch.tensor(fused_logprobs), torch.tensor(plain_logprobs)) < 1e-4
