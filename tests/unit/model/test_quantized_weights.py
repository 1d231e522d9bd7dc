"""GGUF blocks kept quantized (workers/quant/): the C kernels against gguf's own
dequantization (and their portable build against the native one), the layers' product
paths, and whole tiny models swapped into their blocks giving their float twin's greedy
tokens through the engine."""

from __future__ import annotations

import copy
import functools
import platform

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from tests.support.engines import make_engine, run_to_completion
from tests.support.tiny_models import build_tiny_llama
from workers.contract.sampling_params import SamplingParams
from workers.model.fused_projections import fuse_sibling_projections
from workers.model.gguf_packing import keep_gguf_weights_packed
from workers.quant import quantized_layers
from workers.quant.k_quants import convert_k_quant
from workers.quant.native_kernels import QuantKernels, kernels
from workers.quant.packed_weights import (
    PackedWeight,
    deinterleave_rows,
    interleave_rows,
    read_gguf_weights,
)
from workers.quant.quantized_layers import QuantizedEmbedding, QuantizedLinear

Q = gguf.GGMLQuantizationType
FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q8_0]
K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def _random_k_quant(fmt, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """`rows` x `cols` weights as random K-quant super-blocks (gguf-py cannot quantize to
    K-quants; any bytes are valid ones, given finite fp16 super-scales, sized here for
    weights of about the tiny models' spread)."""
    supers = rows * cols // 256
    blocks = rng.integers(0, 256, (supers, gguf.GGML_QUANT_SIZES[fmt][1]), dtype=np.uint8)
    if fmt == Q.Q6_K:  # d at the end: w = d * scale (int8) * (q - 32)
        blocks[:, 208:210] = rng.uniform(2e-5, 1e-4, (supers, 1)).astype(np.float16).view(np.uint8)
    else:  # d and dmin first: w = d * scale * q - dmin * minimum (6-bit scales)
        blocks[:, 0:4] = rng.uniform(2e-4, 2e-3, (supers, 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def _file_blocks(weight: np.ndarray, fmt, rng: np.random.Generator) -> np.ndarray:
    """The bytes a GGUF file holds for `weight` in `fmt`: quantized by gguf-py, or, for a
    K-quant, random blocks of its shape (the model then takes their dequantized values)."""
    if fmt in K_QUANTS:
        return _random_k_quant(fmt, *weight.shape, rng)
    return gguf.quants.quantize(weight, fmt)

pytestmark = pytest.mark.skipif(kernels() is None, reason="no C compiler to build the quantized kernels")


# A tiny random Llama quantized into a GGUF file the way llama.cpp's converter writes it
# (q/k rows interleaved per head, blocks of the chosen format), and its float twin: the
# same model holding exactly the dequantized weights, as transformers would load them.
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (transformers undoes it on load)."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def _llama_cpp_permute_back(weight: np.ndarray, heads: int) -> np.ndarray:
    """The inverse, written out on its own (the product reuses transformers' rule)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _quantized_llama(path, fmt: gguf.GGMLQuantizationType, seed: int = 0, embedding_fmt=None,
                    **overrides) -> torch.nn.Module:
    """Write `path` (a GGUF of the tiny Llama's weights in `fmt`; the embedding in
    `embedding_fmt`, default `fmt`) and return the float twin, fused as the loader fuses."""
    model = build_tiny_llama(vocab_size=96, seed=seed, **overrides)
    config, rng = model.config, np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    tensors = [("token_embd.weight", model.model.embed_tokens, None, embedding_fmt or fmt)]
    if not config.tie_word_embeddings:
        tensors.append(("output.weight", model.lm_head, None, fmt))
    for index, layer in enumerate(model.model.layers):
        for module_path, name in LAYER_NAMES.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(name)
            tensors.append((f"blk.{index}.{name}.weight", layer.get_submodule(module_path), heads, fmt))
    for name, module, heads, tensor_fmt in tensors:
        weight = module.weight.detach().float().numpy()
        stored = _llama_cpp_permute(weight, heads) if heads else weight
        blocks = _file_blocks(stored, tensor_fmt, rng)
        dequantized = gguf.quants.dequantize(blocks, tensor_fmt).reshape(stored.shape)
        if heads:
            dequantized = _llama_cpp_permute_back(dequantized, heads)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(dequantized))
        writer.add_tensor(name, blocks, raw_dtype=tensor_fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    fuse_sibling_projections(model)
    return model


def _twin_pair(path, fmt, **kwargs) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(float twin, a copy of it to swap the GGUF's blocks into)."""
    twin = _quantized_llama(path, fmt, **kwargs)
    return twin, copy.deepcopy(twin)


def _packed(fmt, rows: int, cols: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    """Random weights in `fmt` and their dequantized float32 values (gguf's reference)."""
    weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    blocks = gguf.quants.quantize(weight, fmt)
    reference = gguf.quants.dequantize(blocks, fmt).reshape(rows, cols)
    return PackedWeight(int(fmt), torch.from_numpy(blocks.copy()), cols), torch.from_numpy(reference)


def _packed_k_quant(fmt, rows: int, cols: int, seed: int = 0) -> tuple[PackedWeight, torch.Tensor]:
    """Random K-quant weights rewritten for the kernels, and gguf's dequantization of them."""
    raw = _random_k_quant(fmt, rows, cols, np.random.default_rng(seed))
    reference = gguf.quants.dequantize(raw, fmt).reshape(rows, cols).astype(np.float32)
    converted, blocks = convert_k_quant(int(fmt), raw)
    return PackedWeight(converted, torch.from_numpy(blocks), cols), torch.from_numpy(reference)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantized_rows_are_ggufs_own(fmt):
    packed, reference = _packed(fmt, 37, 96)
    out = kernels().dequantize(packed.fmt, packed.blocks, packed.cols, torch.empty(37, 96))
    assert torch.equal(out, reference)
    rows = torch.tensor([36, 0, 5, 5])
    picked = kernels().dequantize(packed.fmt, packed.blocks, packed.cols, torch.empty(4, 96), rows=rows)
    assert torch.equal(picked, reference[rows])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("rows", [1, 2, 7, 9, 40, 41, 130])
def test_products_equal_the_dequantized_float_product(fmt, rows):
    """Both layouts: the file's rows with float32 activations (widening up to
    KERNEL_MAX_ROWS rows, dequantized slices beyond) equal the dequantized product; the
    interleaved rows with 8-bit activations are within their rounding of it, one level or
    two (300 outputs: the last group of 8 is padded)."""
    packed, reference = _packed(fmt, 300, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(rows))
    want = x @ reference.t()
    exact = QuantizedLinear(packed, kernels(), None, torch.float32, activations="float32")
    torch.testing.assert_close(exact(x), want, rtol=1e-4, atol=1e-4)
    rounded = QuantizedLinear(packed, kernels(), None, torch.float32, activations="int8")(x)
    assert rounded.shape == want.shape
    assert 2e-3 < _relative_error(rounded, want) < 0.02  # the activations' 8-bit rounding, and no more
    twice = QuantizedLinear(packed, kernels(), None, torch.float32, activations="int8x2")(x)
    assert 0 < _relative_error(twice, want) < 1e-4


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("activations", ["int8", "int8x2"])
def test_a_rows_8_bit_product_does_not_depend_on_its_batch(fmt, activations):
    """Each row gets the same bits alone, first or last in a batch of any size (the
    panels and the 4-row tiles of interleaved_matmul cut the batch differently)."""
    packed, _ = _packed(fmt, 64, 1024)
    layer = QuantizedLinear(packed, kernels(), None, torch.float32, activations)
    x = torch.randn(70, 1024, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([layer(x[i:i + 1]) for i in range(70)])
    assert torch.equal(layer(x), alone)
    assert torch.equal(layer(x[3:9]), alone[3:9])


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_interleaved_rows_are_the_same_bytes_moved(fmt):
    packed, _ = _packed(fmt, 24, 96)
    interleaved = interleave_rows(packed.blocks, packed.fmt)
    assert interleaved.shape == (3, packed.blocks.shape[1] * 8)
    assert torch.equal(interleaved.flatten().sort().values, packed.blocks.flatten().sort().values)
    assert torch.equal(deinterleave_rows(interleaved, packed.fmt, 96), packed.blocks)
    layer = QuantizedLinear(PackedWeight(packed.fmt, packed.blocks[:21], 96), kernels(), None, torch.float32)
    assert torch.equal(layer.row_blocks(), packed.blocks[:21])  # the padding rows dropped


def _portable_kernels(tmp_path) -> QuantKernels:
    """cpu_kernels.c built for a plain x86-64 (or the host's own arch elsewhere): the loops
    a CPU without AVX2 runs."""
    import ctypes
    import platform
    import subprocess

    from workers.quant import native_kernels

    arch = ["-march=x86-64"] if platform.machine() == "x86_64" else []
    target = tmp_path / "portable.so"
    subprocess.run(["gcc", "-O2", "-fopenmp", "-shared", "-fPIC", *arch, "-o", str(target),
                    str(native_kernels.SOURCE)], check=True, capture_output=True, timeout=120)
    return QuantKernels(ctypes.CDLL(str(target)))


@pytest.mark.parametrize("fmt", FORMATS + K_QUANTS, ids=lambda f: f.name)
def test_portable_build_computes_what_the_native_one_does(tmp_path, fmt):
    portable, native = _portable_kernels(tmp_path), kernels()
    packed, reference = _packed_k_quant(fmt, 48, 256) if fmt in K_QUANTS else _packed(fmt, 48, 256)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    assert torch.equal(portable.dequantize(packed.fmt, packed.blocks, 256, torch.empty(48, 256)), reference)
    torch.testing.assert_close(portable.matmul(packed.fmt, packed.blocks, 256, x), x @ reference.t(),
                               rtol=1e-4, atol=1e-4)
    interleaved = interleave_rows(packed.blocks, packed.fmt)
    for levels in (1, 2):  # the same integers; float sums in another order
        got = portable.interleaved_matmul(packed.fmt, interleaved, 48, 256, x, levels)
        assert _relative_error(got, native.interleaved_matmul(packed.fmt, interleaved, 48, 256, x, levels)) < 1e-5


@functools.cache
def _gcc_macros() -> str:
    """The macros gcc defines for this CPU (-march=native); empty without gcc."""
    import shutil
    import subprocess

    if shutil.which("gcc") is None:
        return ""
    return subprocess.run(["gcc", "-march=native", "-dM", "-E", "-"], input="", capture_output=True, text=True,
                          timeout=60).stdout


def _has_vnni() -> bool:
    macros = _gcc_macros()
    return "__AVXVNNI__" in macros or ("__AVX512VNNI__" in macros and "__AVX512VL__" in macros)


@pytest.mark.skipif(platform.machine() != "x86_64" or not _has_vnni(), reason="a CPU with VNNI (integer dot products)")
@pytest.mark.parametrize("fmt", FORMATS + K_QUANTS, ids=lambda f: f.name)
def test_vnni_products_equal_the_avx2_ones_bit_for_bit(tmp_path_factory, fmt):
    """The native build's VNNI dot products (and, with AVX-512 VNNI, two groups of 8 output
    features a 512-bit register) against the same source built without VNNI (maddubs +
    madd, one group at a time): integer sums, so the very same floats at 1 to 9 rows and
    both levels, with an even and an odd number of groups (the last one alone)."""
    avx2, native = _native_build_without(tmp_path_factory, "-mno-avxvnni", "-mno-avx512vnni"), kernels()
    for features in (48, 56):
        packed, _ = _packed_k_quant(fmt, features, 256) if fmt in K_QUANTS else _packed(fmt, features, 256)
        interleaved = interleave_rows(packed.blocks, packed.fmt)
        for rows in (1, 4, 9):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            for levels in (1, 2):
                assert torch.equal(avx2.interleaved_matmul(packed.fmt, interleaved, features, 256, x, levels),
                                   native.interleaved_matmul(packed.fmt, interleaved, features, 256, x, levels))


_VARIANTS: dict[tuple[str, ...], QuantKernels] = {}


def _native_build_without(tmp_path_factory, *flags: str) -> QuantKernels:
    """cpu_kernels.c built for this CPU less some instructions (`flags`: gcc's -mno-...), once
    a session: the path a CPU without them runs, to compare with the native build."""
    import ctypes
    import subprocess

    from workers.quant import native_kernels

    if flags not in _VARIANTS:
        target = tmp_path_factory.mktemp("kernels") / "variant.so"
        subprocess.run(["gcc", "-O3", "-march=native", *flags, "-fopenmp", "-shared", "-fPIC", "-o", str(target),
                        str(native_kernels.SOURCE)], check=True, capture_output=True, timeout=120)
        _VARIANTS[flags] = QuantKernels(ctypes.CDLL(str(target)))
    return _VARIANTS[flags]


@pytest.mark.skipif(platform.machine() != "x86_64" or "__AMX_INT8__" not in _gcc_macros()
                    or "__AVX512VNNI__" not in _gcc_macros(), reason="a CPU with AMX int8 tiles")
@pytest.mark.parametrize("fmt", FORMATS + K_QUANTS, ids=lambda f: f.name)
def test_amx_products_equal_the_vnni_ones_bit_for_bit(tmp_path_factory, fmt):
    """The native build's AMX tiles (16 rows x 32 columns x 16 features a multiply, from 8
    8-bit rows on) against the same source built without AMX: the same integer sums and
    FMAs, so the very same floats, on both sides of the threshold, full tiles and a short
    last one, both levels, an odd last group, and the fused path's norm prologue and
    residual add."""
    from workers.quant.native_kernels import PROLOGUE_RMS_NORM

    vnni, native = _native_build_without(tmp_path_factory, "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"), kernels()
    norm = torch.rand(256, generator=torch.Generator().manual_seed(0)) + 0.5
    for features in (48, 56):
        packed, _ = _packed_k_quant(fmt, features, 256) if fmt in K_QUANTS else _packed(fmt, features, 256)
        interleaved = interleave_rows(packed.blocks, packed.fmt)
        for rows in (3, 4, 7, 8, 16, 17, 40):
            x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows))
            for levels in (1, 2):
                assert torch.equal(vnni.interleaved_matmul(packed.fmt, interleaved, features, 256, x, levels),
                                   native.interleaved_matmul(packed.fmt, interleaved, features, 256, x, levels))
            residual = torch.randn(rows, features, generator=torch.Generator().manual_seed(100 + rows))
            fused = [k.fused_interleaved_matmul(packed.fmt, interleaved, 256, x, residual.clone(), 2, PROLOGUE_RMS_NORM,
                                                norm, 1e-5, accumulate=True) for k in (vnni, native)]
            assert torch.equal(*fused)


def test_portable_build_widens_every_e4m3_code_as_torch_does(tmp_path):
    """FP8 blocks (fp8_blocks.py) through the portable loops, whose fp16 conversion is
    software (no F16C), subnormal codes included."""
    from workers.quant.fp8_blocks import fp8_blocks

    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].repeat(49)[:48 * 256].view(torch.float8_e4m3fn).view(48, 256)
    scale = torch.rand(48, 1, generator=torch.Generator().manual_seed(4))
    packed, reference = fp8_blocks(codes, scale), codes.float() * scale
    portable = _portable_kernels(tmp_path)
    assert torch.equal(portable.dequantize(packed.fmt, packed.blocks, 256, torch.empty(48, 256)), reference)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(portable.matmul(packed.fmt, packed.blocks, 256, x), x @ reference.t(),
                               rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="interleaved_matmul: format 130"):  # codes are not integers
        portable.interleaved_matmul(packed.fmt, packed.blocks, 48, 256, x, 1)


@pytest.mark.parametrize("fmt", K_QUANTS, ids=lambda f: f.name)
def test_k_quants_are_rewritten_exactly(fmt):
    """Q4_K/Q5_K/Q6_K super-blocks become blocks of 32 with float32 fields that dequantize
    to gguf's own floats, bit for bit, and multiply like the other formats."""
    packed, reference = _packed_k_quant(fmt, 40, 512, seed=int(fmt))
    assert packed.format_name == ("Q4_F32" if fmt == Q.Q4_K else "Q8_F32")
    assert torch.equal(kernels().dequantize(packed.fmt, packed.blocks, 512, torch.empty(40, 512)), reference)
    assert torch.equal(deinterleave_rows(interleave_rows(packed.blocks, packed.fmt), packed.fmt, 512), packed.blocks)
    x = torch.randn(20, 512, generator=torch.Generator().manual_seed(3))
    want = x @ reference.t()
    exact = QuantizedLinear(packed, kernels(), None, torch.float32, activations="float32")
    torch.testing.assert_close(exact(x), want, rtol=1e-4, atol=1e-4)
    assert 2e-3 < _relative_error(QuantizedLinear(packed, kernels(), None, torch.float32, "int8")(x), want) < 0.02
    assert _relative_error(QuantizedLinear(packed, kernels(), None, torch.float32, "int8x2")(x), want) < 1e-4


def test_slices_of_a_large_layer_cover_every_output(monkeypatch):
    monkeypatch.setattr(quantized_layers, "SCRATCH_FLOATS", 160 * 7)  # 7 rows a slice: 43 slices
    packed, reference = _packed(Q.Q4_1, 300, 160)
    bias = torch.randn(300)
    layer = QuantizedLinear(packed, kernels(), bias, torch.bfloat16, activations="float32")
    x = torch.randn(2, 50, 160, dtype=torch.bfloat16)
    out = layer(x)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 50, 300)
    torch.testing.assert_close(out.float(), x.float() @ reference.t() + bias, rtol=2e-2, atol=5e-2)
    assert layer.weight.is_meta and layer.weight.shape == (300, 160)


def test_embedding_looks_up_dequantized_rows_and_refuses_unknown_ids():
    packed, reference = _packed(Q.Q8_0, 50, 64)
    embedding = QuantizedEmbedding(packed, kernels(), torch.float32)
    ids = torch.tensor([[3, 49], [0, 3]])
    assert torch.equal(embedding(ids), reference[ids])
    for bad in (50, -1):
        with pytest.raises(IndexError):
            embedding(torch.tensor([[1, bad]]))


def test_gguf_file_reads_blocks_by_name(tmp_path):
    twin, _ = _twin_pair(tmp_path / "m.gguf", Q.Q4_1, embedding_fmt=Q.Q8_0)
    weights = read_gguf_weights(tmp_path / "m.gguf")
    assert weights["token_embd.weight"].format_name == "Q8_0"
    assert (weights["blk.1.ffn_down.weight"].rows, weights["blk.1.ffn_down.weight"].cols) == (64, 128)
    assert weights["output.weight"].fmt == int(Q.Q4_1)


PROMPTS = [[1 + (7 * i + j) % 90 for j in range(3 + i % 5)] for i in range(16)]


def _hf_greedy(model, prompt: list[int], n: int = 12) -> list[int]:
    """transformers' greedy decoding (tests.support's reference_greedy caches by prompt,
    and each format's twin is another model)."""
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine_greedy(model, n: int = 12) -> list[list[int]]:
    engine = make_engine(model)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
           for prompt in PROMPTS]
    events = run_to_completion(engine)
    return [[ev.token_id for ev in events[request]] for request in ids]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_quantized_model_gives_its_float_twins_greedy_tokens(tmp_path, fmt, tied):
    """16 prompts through the engine (its batches mix one-row and many-row steps), float32
    activations, against transformers' greedy decoding of the dequantized twin."""
    twin, model = _twin_pair(tmp_path / "m.gguf", fmt, tie_word_embeddings=tied)
    replaced = keep_gguf_weights_packed(model, tmp_path / "m.gguf", activations="float32")
    assert replaced == {fmt.name: 10}  # per layer: q/k/v, gate/up, o, down; the embedding and the head
    assert isinstance(model.lm_head, QuantizedLinear) and isinstance(model.model.embed_tokens, QuantizedEmbedding)
    if tied:
        assert model.lm_head.blocks is model.model.embed_tokens.blocks  # one copy
    assert not any(p.dim() > 1 for p in model.parameters())  # no float matrix left
    got = _engine_greedy(model)
    assert got == [_hf_greedy(twin, prompt) for prompt in PROMPTS]


@pytest.mark.parametrize("fmt", K_QUANTS, ids=lambda f: f.name)
def test_k_quant_model_gives_its_float_twins_greedy_tokens(tmp_path, fmt):
    """A tiny Llama (widths of whole 256-weight super-blocks) from a K-quant file, the
    embedding in Q6_K as Q4_K_M files have it: every layer kept quantized, the twin's greedy
    tokens through the engine."""
    twin, model = _twin_pair(tmp_path / "m.gguf", fmt, embedding_fmt=Q.Q6_K, hidden_size=256,
                             intermediate_size=512)
    replaced = keep_gguf_weights_packed(model, tmp_path / "m.gguf", activations="float32")
    converted = "Q4_F32" if fmt == Q.Q4_K else "Q8_F32"
    assert replaced == ({converted: 9, "Q8_F32": 1} if converted == "Q4_F32" else {"Q8_F32": 10})
    assert not any(p.dim() > 1 for p in model.parameters())
    assert _engine_greedy(model) == [_hf_greedy(twin, prompt) for prompt in PROMPTS]


def test_a_layer_its_blocks_do_not_reproduce_stays_float(tmp_path, caplog):
    _, model = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[0, 0] += 1.0  # no longer the file's weight
    replaced = keep_gguf_weights_packed(model, tmp_path / "m.gguf")
    assert replaced == {"Q4_1": 9}
    assert type(model.model.layers[1].mlp.down_proj) is nn.Linear
    assert isinstance(model.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert "blk.1.ffn_down.weight" in caplog.text and "stay in float" in caplog.text


@pytest.mark.parametrize("activations, bound", [("int8x2", 1e-3), ("int8", 0.03)])
def test_8_bit_activations_stay_close_to_the_float_twin(tmp_path, activations, bound):
    """Rounded activations: logits within their rounding of the twin's (the default, two
    levels, float-like)."""
    twin, model = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf", activations)
    assert model.model.layers[0].mlp.down_proj.activations == activations
    assert model.lm_head.activations == "int8x2"  # never one rounding: near-tied logits stay put
    with torch.inference_mode():
        want = twin(torch.tensor([[5, 17, 3, 40]])).logits
        got = model(torch.tensor([[5, 17, 3, 40]])).logits
    assert 0 < _relative_error(got, want) < bound


def test_lora_wraps_quantized_projections(tmp_path):
    from workers.core.limits import LoraLimits
    from workers.lora.layers import LoraContext, LoraLinear
    from workers.lora.manager import wrap_targets

    _, model = _twin_pair(tmp_path / "m.gguf", Q.Q4_1)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf")
    targets = wrap_targets(model, LoraLimits(max_loras=2, max_rank=4), LoraContext())
    assert isinstance(model.model.layers[0].mlp.down_proj, LoraLinear)
    assert isinstance(model.model.layers[0].mlp.down_proj.base, QuantizedLinear)
    assert "model.layers.0.self_attn.o_proj" in targets


def test_deepcopy_keeps_one_block_tensor_per_layer(tmp_path):
    _, model = _twin_pair(tmp_path / "m.gguf", Q.Q8_0, tie_word_embeddings=True)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf")
    clone = copy.deepcopy(model)
    assert clone.lm_head.blocks is clone.model.embed_tokens.blocks


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_a_tied_embedding_reads_its_rows_from_the_heads_interleaved_blocks(tmp_path, fmt):
    """One copy of the tied weight, interleaved for the head's 8-bit products: the
    embedding's rows are its float twin's, and the head's product is within its rounding."""
    twin, model = _twin_pair(tmp_path / "m.gguf", fmt, tie_word_embeddings=True)
    keep_gguf_weights_packed(model, tmp_path / "m.gguf")
    embedding, head = model.model.embed_tokens, model.lm_head
    assert embedding.blocks is head.blocks and embedding.interleaved and head.levels == 2
    ids = torch.tensor([[0, 95, 7], [7, 3, 50]])
    assert torch.equal(embedding(ids), twin.model.embed_tokens(ids))
    x = torch.randn(4, 64)
    assert _relative_error(head(x), twin.lm_head(x)) < 1e-4


def test_pickled_layer_computes_the_same(tmp_path):
    import pickle

    packed, _ = _packed(Q.Q4_1, 40, 64)
    layer = QuantizedLinear(packed, kernels(), None, torch.float32)
    x = torch.randn(3, 64)
    assert torch.equal(pickle.loads(pickle.dumps(layer))(x), layer(x))
