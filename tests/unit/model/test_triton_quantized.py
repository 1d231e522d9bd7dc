"""The CUDA products with quantized weights (workers/quant/triton_matmul.py), run on CPU
through Triton's interpreter as test_triton_attention.py runs its kernel: the cases run in
a child pytest started with TRITON_INTERPRET=1 (`test_kernels_under_interpreter`); on a
GPU they run compiled. Each format's device layout widens to gguf's own floats; the
products equal the dequantized float product (float32 exactly up to summation order,
fp16 within its rounding); a tiny GGUF model swapped for a CUDA target gives its float
twin's greedy tokens."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.gpu  # on CPU through the interpreter; on a GPU compiled

from tests.support.paths import REPO_ROOT  # noqa: E402
from tests.unit.model.test_quantized_weights import (  # noqa: E402
    FORMATS,
    K_QUANTS,
    _hf_greedy,
    _packed,
    _packed_k_quant,
    _twin_pair,
)
from workers.model.gguf_packing import keep_gguf_weights_packed  # noqa: E402
from workers.quant.fp8_blocks import fp8_blocks  # noqa: E402
from workers.quant.native_kernels import kernels  # noqa: E402
from workers.quant.quantized_layers import DeviceQuantizedLinear  # noqa: E402
from workers.quant.triton_matmul import DeviceBlocks, dequantized_matmul  # noqa: E402

Q = gguf.GGMLQuantizationType
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interpreted_or_gpu = pytest.mark.skipif(not (INTERPRETED or torch.cuda.is_available()),
                                        reason="run in a child by test_kernels_under_interpreter")


@pytest.mark.skipif(INTERPRETED, reason="this is the child run")
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the cases run compiled")
@pytest.mark.skipif(kernels() is None, reason="no C compiler: no packed weights to swap in")
def test_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest", __file__]
    result = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "9 passed" in result.stdout, result.stdout[-2000:]  # every case ran


def _weight(fmt, rows: int = 72, cols: int = 256):
    return _packed_k_quant(fmt, rows, cols) if fmt in K_QUANTS else _packed(fmt, rows, cols)


@interpreted_or_gpu
@pytest.mark.parametrize("fmt", FORMATS + K_QUANTS, ids=lambda f: f.name)
def test_device_blocks_widen_to_ggufs_floats_and_multiply(fmt):
    packed, reference = _weight(fmt)
    blocks = DeviceBlocks.of(packed, DEVICE)
    assert torch.equal(blocks.dequantized().cpu(), reference)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    want = x @ reference.t()
    torch.testing.assert_close(dequantized_matmul(x.to(DEVICE), blocks).cpu(), want, rtol=1e-4, atol=1e-4)
    half = dequantized_matmul(x.half().to(DEVICE), blocks).cpu().float()
    torch.testing.assert_close(half, x.half().float() @ reference.half().float().t(), rtol=2e-2, atol=2e-2)


@interpreted_or_gpu
def test_fp8_device_blocks_widen_every_e4m3_code_and_multiply():
    """Every e4m3 code (NaN aside), with 32 x 32 block scales: the kernel's widening of the
    codes' bits equals torch's `codes.float() * scale`."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(40)[:72 * 128].view(torch.float8_e4m3fn).view(72, 128)
    scale = torch.rand(3, 4, generator=torch.Generator().manual_seed(2)) * 0.01
    reference = codes.float() * scale.repeat_interleave(32, 0)[:72].repeat_interleave(32, 1)
    blocks = DeviceBlocks.of(fp8_blocks(codes, scale, (32, 32)), DEVICE)
    assert torch.equal(blocks.dequantized().cpu(), reference)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(dequantized_matmul(x.to(DEVICE), blocks).cpu(), x @ reference.t(),
                               rtol=1e-4, atol=1e-4)


@interpreted_or_gpu
def test_device_layer_gathers_its_input_order_and_adds_its_bias():
    packed, reference = _weight(Q.Q4_1, 40, 128)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(3))
    bias = torch.randn(40)
    layer = DeviceQuantizedLinear(packed, bias, torch.float32, input_order=order).to(DEVICE)
    natural = torch.empty_like(reference)
    natural[:, order] = reference  # the packed columns are the inputs in `order`
    x = torch.randn(2, 3, 128)
    torch.testing.assert_close(layer(x.to(DEVICE)).cpu(), x @ natural.t() + bias, rtol=1e-4, atol=1e-4)
    assert torch.equal(layer.dequantized().cpu(), natural)


@interpreted_or_gpu
def test_a_model_swapped_for_cuda_gives_its_float_twins_tokens(tmp_path):
    """The swap for a CUDA target (linears on the Triton kernel, the embedding float), then
    the model on its device: transformers' greedy tokens equal the dequantized twin's (the
    K-quant layouts are covered above: a model of their 256-wide rows is slow to interpret)."""
    twin, model = _twin_pair(tmp_path / "m.gguf", Q.Q4_0)
    replaced = keep_gguf_weights_packed(model, tmp_path / "m.gguf", device="cuda")
    assert sum(replaced.values()) == 9  # 4 a layer and the head; the embedding stays float
    assert isinstance(model.lm_head, DeviceQuantizedLinear)
    model.to(DEVICE)
    for prompt in ([5, 17, 3], [40, 2, 9, 11, 7]):
        x = torch.tensor([prompt], device=DEVICE)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=4,
                             eos_token_id=None, pad_token_id=0)
        assert out[0, len(prompt):].tolist() == _hf_greedy(twin, prompt, 4)
