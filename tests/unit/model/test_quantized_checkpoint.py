"""GPTQ, AWQ and FP8 checkpoints dequantized once into a float directory
(workers/model/quantized_checkpoint.py): each format's rule against this file's own packer
(written from the formats' descriptions, not from the module), within quantization error
of the float weights, and a tiny Llama quantized in each format that loads through
prepare_model_dir + load_model and generates what its float twin generates."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.support.tiny_models import write_tiny_model_dir
from workers.model import quantized_checkpoint as qc
from workers.model.loader import load_model, prepare_model_dir
from workers.quant.native_kernels import kernels
from workers.quant.quantized_layers import QuantizedLinear

# AutoAWQ's packer: nibble k of each int32 holds column AWQ_PACK_ORDER[k] of its 8.
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [
    "Hi",
    "Hello there",
    "The quick brown fox",
    "def add(a, b):\n    return a + b",
    "Paris is the capital of France. Berlin is",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000",
    "Unicode: café naïve 你好 世界 😀 — emoji and accents.",
    "Hello! How can I assist you today? I am a helpful assistant. The quick brown fox jumps over",
]


# This file's own packers: quantize per group, pack nibbles into int32 with each format's order.

def as_int32(packed: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(packed.astype(np.uint32).view(np.int32).copy())


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """[in, out] nibbles -> [in/8, out] int32; nibble k of row r is input row 8r+k (GPTQ qweight)."""
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0] // 8, v.shape[1]), dtype=np.uint32)
    for k in range(8):
        packed |= v[k::8] << np.uint32(4 * k)
    return as_int32(packed)


def pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[r, c] nibbles -> [r, c/8] int32; nibble k of word b is column 8b + order[k]."""
    v = values.numpy().astype(np.uint32)
    packed = np.zeros((v.shape[0], v.shape[1] // 8), dtype=np.uint32)
    for k, column in enumerate(order):
        packed |= v[:, column::8] << np.uint32(4 * k)
    return as_int32(packed)


def quantize_int4(weight: torch.Tensor, groups: torch.Tensor):
    """Asymmetric 4-bit min/max quantization of `weight` [out, in] with input row i in group
    groups[i]: q [in, out], zeros [G, out], fp16 scales [G, out], and the dequantized
    float32 reference [out, in]. The range spans 14 steps so rounding never clamps: every
    element is within scale/2 of the original."""
    weight_t = weight.t().float()
    n_groups = int(groups.max()) + 1
    scales = torch.empty(n_groups, weight.shape[0], dtype=torch.float16)
    zeros = torch.empty(n_groups, weight.shape[0], dtype=torch.long)
    for g in range(n_groups):
        rows = weight_t[groups == g]
        lo, hi = rows.min(0).values.clamp(max=0), rows.max(0).values.clamp(min=0)
        scales[g] = ((hi - lo) / 14).clamp(min=1e-3).half()
        zeros[g] = torch.round(-lo / scales[g].float()).long()
    s, z = scales.float()[groups], zeros[groups]
    q = torch.round(weight_t / s + z).long()
    assert q.min() >= 0 and q.max() <= 15
    reference = torch.empty_like(weight_t)
    for i in range(weight_t.shape[0]):  # row by row, as the formula reads
        reference[i] = scales[groups[i]].float() * (q[i] - zeros[groups[i]]).float()
    return q, zeros, scales, reference.t().contiguous()


def gptq_groups(in_features: int, group_size: int, act_order: bool, seed: int = 0) -> torch.Tensor:
    """g_idx: consecutive groups, or with act-order the groups of a random row order."""
    size = in_features if group_size == -1 else group_size
    rank = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(in_features)
    return rank // size


def quantize_gptq(weight: torch.Tensor, group_size: int, act_order: bool = False, fmt: str = "gptq"):
    groups = gptq_groups(weight.shape[1], group_size, act_order)
    q, zeros, scales, reference = quantize_int4(weight, groups)
    stored_zeros = zeros - 1 if fmt == "gptq" else zeros  # v1 stores zero-1
    assert stored_zeros.min() >= 0
    tensors = {"qweight": pack_rows(q), "qzeros": pack_columns(stored_zeros), "scales": scales,
               "g_idx": groups.to(torch.int32)}
    return tensors, reference


def quantize_awq(weight: torch.Tensor, group_size: int):
    groups = torch.arange(weight.shape[1]) // group_size
    q, zeros, scales, reference = quantize_int4(weight, groups)
    tensors = {"qweight": pack_columns(q, AWQ_PACK_ORDER), "qzeros": pack_columns(zeros, AWQ_PACK_ORDER),
               "scales": scales}
    return tensors, reference


def quantize_fp8(weight: torch.Tensor, scheme: str, block: tuple[int, int] = (128, 128)):
    """(float8 weight, scale, expanded scale [out, in]) for 'tensor', 'channel' or 'block'."""
    out_features, in_features = weight.shape
    if scheme == "tensor":
        scale = weight.abs().max() / 448
        expanded = scale.expand(out_features, in_features)
    elif scheme == "channel":
        scale = weight.abs().amax(1, keepdim=True) / 448
        expanded = scale.expand(out_features, in_features)
    else:
        rows, cols = block
        scale = torch.empty(-(-out_features // rows), -(-in_features // cols))
        expanded = torch.empty_like(weight)
        for bi in range(scale.shape[0]):
            for bj in range(scale.shape[1]):
                part = (slice(bi * rows, (bi + 1) * rows), slice(bj * cols, (bj + 1) * cols))
                scale[bi, bj] = weight[part].abs().max() / 448
                expanded[part] = scale[bi, bj]
    quantized = (weight / expanded).to(torch.float8_e4m3fn)
    return quantized, scale, expanded


def random_weight(out_features: int = 64, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) * 0.2


def assert_int4_error(dequantized: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, groups: torch.Tensor):
    bound = scales.float()[groups].t() / 2 * (1 + 1e-3) + 1e-6  # [out, in]
    assert ((dequantized - weight).abs() <= bound).all()


# The rules, format by format.

@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("group_size", [32, 64, -1])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_dequantizes_to_its_reference(group_size, act_order, fmt):
    weight = random_weight()
    tensors, reference = quantize_gptq(weight, group_size, act_order, fmt)
    offset = 1 if fmt == "gptq" else 0
    out = qc.dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], tensors["g_idx"],
                             group_size, zero_offset=offset)
    assert out.dtype == torch.float32 and out.shape == (64, 128)
    assert torch.equal(out, reference)
    assert_int4_error(out, weight, tensors["scales"], tensors["g_idx"].long())
    if not act_order:  # without g_idx the groups are consecutive rows
        assert torch.equal(qc.dequantize_gptq(tensors["qweight"], tensors["qzeros"], tensors["scales"], None,
                                              group_size, zero_offset=offset), reference)


def test_gptq_v1_stores_zero_minus_one_and_v2_the_zero():
    weight = random_weight(seed=1)
    v1, reference = quantize_gptq(weight, 32, fmt="gptq")
    v2, reference_v2 = quantize_gptq(weight, 32, fmt="gptq_v2")
    assert torch.equal(reference, reference_v2) and not torch.equal(v1["qzeros"], v2["qzeros"])
    assert torch.equal(qc.dequantize_gptq(v1["qweight"], v1["qzeros"], v1["scales"], v1["g_idx"], 32, 1), reference)
    assert torch.equal(qc.dequantize_gptq(v2["qweight"], v2["qzeros"], v2["scales"], v2["g_idx"], 32, 0), reference)
    wrong = qc.dequantize_gptq(v2["qweight"], v2["qzeros"], v2["scales"], v2["g_idx"], 32, 1)
    assert not torch.allclose(wrong, reference)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_dequantizes_to_its_reference(group_size):
    weight = random_weight(seed=2)
    tensors, reference = quantize_awq(weight, group_size)
    out = qc.dequantize_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], group_size)
    assert out.dtype == torch.float32 and out.shape == (64, 128)
    assert torch.equal(out, reference)
    assert_int4_error(out, weight, tensors["scales"], torch.arange(128) // group_size)


def test_awq_order_is_interleaved():
    values = torch.arange(8).view(1, 8)  # columns 0..7 holding their own index
    packed = pack_columns(values, AWQ_PACK_ORDER)
    nibbles = [(int(packed) >> (4 * k)) & 0xF for k in range(8)]
    assert nibbles == AWQ_PACK_ORDER
    assert qc.unpack_awq(packed).tolist() == [list(range(8))]


@pytest.mark.parametrize("scheme, shape", [("tensor", (64, 128)), ("tensor-1", (64, 128)), ("channel", (64, 128)),
                                           ("channel-flat", (64, 128)), ("block", (192, 320))])
def test_fp8_dequantizes_to_its_reference(scheme, shape):
    weight = random_weight(*shape, seed=3)
    quantized, scale, expanded = quantize_fp8(weight, scheme.split("-")[0])
    if scheme == "tensor-1":
        scale = scale.reshape(1)
    if scheme == "channel-flat":
        scale = scale.reshape(-1)
    block = [128, 128] if scheme == "block" else None
    if block:
        assert scale.shape == (2, 3)  # 192 x 320: partial blocks on both edges
    out = qc.dequantize_fp8(quantized, scale, block)
    assert out.dtype == torch.float32 and out.shape == shape
    assert torch.equal(out, quantized.float() * expanded)
    assert ((out - weight).abs() <= 2**-3 * weight.abs() + expanded * 2**-9).all()


def test_fp8_block_scales_must_fit_the_weight():
    quantized, scale, _ = quantize_fp8(random_weight(192, 320), "block")
    with pytest.raises(ValueError, match=r"do not fit weight \(192, 320\) in blocks of \[64, 64\]"):
        qc.dequantize_fp8(quantized, scale, [64, 64])


# Directories: the method, the settings refused, the conversion.

def write_config(path: Path, quantization_config: dict | None, **extra) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", **extra}
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_the_method_is_read_from_the_config(tmp_path):
    assert qc.quantization_method(write_config(tmp_path / "plain", None)) is None
    assert qc.quantization_method(write_config(tmp_path / "g", {"quant_method": "GPTQ", "bits": 4})) == "gptq"
    assert qc.quantization_method(write_config(tmp_path / "a", {"quant_method": "awq", "bits": 4})) == "awq"
    assert qc.quantization_method(write_config(tmp_path / "f", {"quant_method": "fp8"})) == "fp8"


@pytest.mark.parametrize("settings, message", [
    ({"quant_method": "bitsandbytes"}, r"quantization 'bitsandbytes' is not supported \(gptq, awq, fp8 load dequantized\)"),
    ({"quant_method": "gptq", "bits": 8}, r"quantization_config.bits=8 is not supported"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format='marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"quantization_config.version='gemv'"),
])
def test_unsupported_quantizations_are_refused_by_name(tmp_path, settings, message):
    model_dir = write_config(tmp_path / "m", settings)
    (model_dir / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match=message):
        qc.quantization_method(model_dir)
    with pytest.raises(ValueError, match=message):
        prepare_model_dir(str(model_dir), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # refused before anything is cached


def test_the_dtype_is_the_configs(tmp_path):
    assert qc.target_dtype({"dtype": "float16"}) == torch.float16
    assert qc.target_dtype({"torch_dtype": "float32"}) == torch.float32
    assert qc.target_dtype({}) == torch.bfloat16
    assert qc.target_dtype({"dtype": "auto"}) == torch.bfloat16


# A tiny Llama in each format, against its float twin.

@pytest.fixture(scope="module")
def float_dir(tmp_path_factory) -> Path:
    return write_tiny_model_dir(tmp_path_factory.mktemp("float") / "tiny")


def is_linear(name: str) -> bool:
    return name.endswith(".weight") and name.removesuffix(".weight").rpartition(".")[2] in LINEARS


def quantize_model(float_dir: Path, method: str, model_dir: Path, twin_dir: Path, shards: int = 1,
                   fp8_scheme: str = "block") -> dict:
    """Write `float_dir`'s model with every decoder linear quantized in `method` at
    `model_dir`, and at `twin_dir` the same model with those weights replaced by this file's
    dequantized references; return the quantization_config used. `fp8_scheme`: block (32 x
    32 blocks, weight_scale_inv), block128 (DeepSeek's 128 x 128: one partial block here),
    tensor or channel (weight_scale)."""
    config = json.loads((float_dir / "config.json").read_text())
    assert config["hidden_size"] % 32 == 0 and config["intermediate_size"] % 32 == 0
    assert config["num_key_value_heads"] * config["head_dim"] % 32 == 0
    settings = {
        "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq"},
        "awq": {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
        "fp8": {"quant_method": "fp8", "activation_scheme": "static"},
    }[method]
    block = {"block": (32, 32), "block128": (128, 128)}.get(fp8_scheme)
    if method == "fp8" and block:
        settings["weight_block_size"] = list(block)
    quantized, twin = {}, {}
    for number, (name, tensor) in enumerate(load_file(float_dir / "model.safetensors").items()):
        if not is_linear(name):
            quantized[name] = twin[name] = tensor
            continue
        prefix = name.removesuffix(".weight")
        if method == "gptq":
            tensors, reference = quantize_gptq(tensor, 32, act_order=True)
        elif method == "awq":
            tensors, reference = quantize_awq(tensor, 32)
        else:
            weight, scale, expanded = quantize_fp8(tensor, "block" if block else fp8_scheme, block)
            tensors = {"weight": weight, "weight_scale_inv" if block else "weight_scale": scale,
                       "input_scale": torch.tensor(0.01 * number)}
            reference = weight.float() * expanded
        quantized.update({f"{prefix}.{part}": value for part, value in tensors.items()})
        twin[name] = reference
    for directory in (model_dir, twin_dir):
        directory.mkdir(parents=True)
        for file in float_dir.iterdir():
            if file.name != "model.safetensors":
                shutil.copy(file, directory / file.name)
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    names = list(quantized)
    parts = [names[k::shards] for k in range(shards)]
    if shards == 1:
        save_file(quantized, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        for k, part in enumerate(parts, 1):
            file = f"model-{k:05d}-of-{shards:05d}.safetensors"
            save_file({n: quantized[n] for n in part}, str(model_dir / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file))
        (model_dir / qc.INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (model_dir / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    (model_dir / "quantize_config.json").write_text(json.dumps(settings))  # AutoGPTQ's side file
    return settings


def greedy_tokens(loaded) -> list[list[int]]:
    tokens = []
    for text in PROMPTS:
        ids = loaded.tokenizer(text, return_tensors="pt")
        with torch.inference_mode():
            out = loaded.model.generate(**ids, do_sample=False, max_new_tokens=8,
                                        pad_token_id=loaded.tokenizer.pad_token_id)
        tokens.append(out[0, ids["input_ids"].shape[1]:].tolist())
    return tokens


@pytest.mark.parametrize("method, shards", [("gptq", 2), ("awq", 1), ("fp8", 1)])
def test_a_quantized_tiny_llama_generates_what_its_float_twin_does(float_dir, tmp_path, method, shards):
    model_dir, twin_dir, cache = tmp_path / f"tiny-{method}", tmp_path / "twin", tmp_path / "cache"
    quantize_model(float_dir, method, model_dir, twin_dir, shards=shards)
    prepared = prepare_model_dir(str(model_dir), cache)
    assert prepared.parent == cache and prepared.name.startswith(f"tiny-{method}-")
    assert not prepared.with_name(prepared.name + ".tmp").exists()
    config = json.loads((prepared / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"} \
        <= {f.name for f in prepared.iterdir()}
    assert not (prepared / "quantize_config.json").exists()
    converted, twin = load_file(prepared / "model.safetensors"), load_file(twin_dir / "model.safetensors")
    assert converted.keys() == twin.keys()  # packed parts and activation scales gone
    for name, tensor in twin.items():
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], tensor), name
    loaded = load_model(str(model_dir), dtype="float32", cache_dir=cache, pack_cpu_weights=False, quantization="none")
    reference = load_model(str(twin_dir), dtype="float32", cache_dir=cache, pack_cpu_weights=False)
    assert loaded.path == prepared
    assert loaded.model.dtype == torch.float32
    tokens = greedy_tokens(loaded)
    assert len({len(loaded.tokenizer(text)["input_ids"]) for text in PROMPTS}) == len(PROMPTS)
    assert tokens == greedy_tokens(reference)
    assert all(len(t) == 8 for t in tokens)


def test_the_conversion_happens_once(float_dir, tmp_path, monkeypatch):
    model_dir, cache = tmp_path / "tiny-awq", tmp_path / "cache"
    quantize_model(float_dir, "awq", model_dir, tmp_path / "twin")
    calls = []
    convert = qc.dequantize_checkpoint
    monkeypatch.setattr(qc, "dequantize_checkpoint", lambda *args: calls.append(args) or convert(*args))
    first = prepare_model_dir(str(model_dir), cache)
    assert prepare_model_dir(str(model_dir), cache) == first and len(calls) == 1
    assert prepare_model_dir(str(first), cache) == first  # the copy itself is a plain directory
    weights = model_dir / "model.safetensors"
    stat = weights.stat()
    os.utime(weights, (stat.st_atime, stat.st_mtime + 10))  # a changed checkpoint converts anew
    second = prepare_model_dir(str(model_dir), cache)
    assert second != first and len(calls) == 2
    assert second.is_dir() and not first.exists()  # the older version's copy does not pile up


def test_a_large_checkpoint_is_written_as_shards_in_the_configs_dtype(float_dir, tmp_path):
    model_dir, target = tmp_path / "tiny-gptq", tmp_path / "out"
    quantize_model(float_dir, "gptq", model_dir, tmp_path / "twin")
    config = json.loads((model_dir / "config.json").read_text())
    del config["dtype"]
    (model_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    qc.dequantize_checkpoint(model_dir, target, max_shard_bytes=64 * 1024)
    index = json.loads((target / qc.INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files == sorted(f.name for f in target.glob("*.safetensors"))
    twin = load_file(tmp_path / "twin" / "model.safetensors")
    converted = {}
    for file in files:
        converted.update(load_file(target / file))
    assert converted.keys() == twin.keys()
    for name, tensor in twin.items():
        expected = tensor.half() if is_linear(name) else tensor  # other tensors as they were
        assert torch.equal(converted[name], expected), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in converted.values())
    loaded = load_model(str(target), dtype="float32", pack_cpu_weights=False, fuse_projections=False)
    weight = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(weight, twin["model.layers.0.self_attn.q_proj.weight"].half().float())


@pytest.mark.skipif(kernels() is None, reason="no C compiler to build the quantized kernels")
@pytest.mark.parametrize("method, fp8_scheme", [("gptq", None), ("awq", None), ("fp8", "block"),
                                                ("fp8", "block128"), ("fp8", "tensor"), ("fp8", "channel")])
def test_quantized_weights_stay_packed_on_a_cpu(float_dir, tmp_path, method, fp8_scheme):
    """quantization: auto keeps every decoder linear in blocks (4-bit ones for GPTQ/AWQ,
    GPTQ's act-order as an input order; e4m3 codes for FP8 at each scale granularity; q/k/v
    and gate/up fused), and the model generates what its float twin does."""
    model_dir, twin_dir, cache = tmp_path / f"tiny-{method}", tmp_path / "twin", tmp_path / "cache"
    quantize_model(float_dir, method, model_dir, twin_dir, fp8_scheme=fp8_scheme)
    loaded = load_model(str(model_dir), dtype="float32", cache_dir=cache, pack_cpu_weights=False,
                        quantized_activations="float32" if method != "fp8" else "int8x2")
    reference = load_model(str(twin_dir), dtype="float32", cache_dir=cache, pack_cpu_weights=False)
    layers = [m for m in loaded.model.modules() if isinstance(m, QuantizedLinear)]
    config = loaded.model.config
    assert len(layers) == 4 * config.num_hidden_layers  # q/k/v fused, o, gate/up fused, down
    assert all(layer.reordered == (method == "gptq") for layer in layers)
    assert all(layer.format_name == ("F8_E4M3" if method == "fp8" else "Q4_F32") for layer in layers)
    assert all(layer.activations == "float32" for layer in layers)  # FP8 codes: the float products only
    assert greedy_tokens(loaded) == greedy_tokens(reference)


@pytest.mark.skipif(kernels() is None, reason="no C compiler to build the quantized kernels")
@pytest.mark.parametrize("group_size, act_order", [(32, False), (64, True), (128, True), (-1, False)])
def test_int4_weights_become_blocks_that_dequantize_to_the_reference(group_size, act_order):
    from workers.quant.int4_blocks import int4_blocks

    weight = random_weight(48, 256, seed=group_size)
    groups = gptq_groups(256, group_size, act_order)
    q, zeros, scales, reference = quantize_int4(weight, groups)
    packed, order = int4_blocks(q, zeros, scales, groups)
    assert (order is not None) == act_order
    layer = QuantizedLinear(packed, kernels(), None, torch.float32, "float32", input_order=order)
    assert torch.equal(layer.dequantized(), reference)
    x = torch.randn(5, 256)
    torch.testing.assert_close(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(kernels() is None, reason="no C compiler to build the quantized kernels")
@pytest.mark.parametrize("scheme, block", [("tensor", None), ("channel", None), ("block", (128, 128)),
                                           ("block", (64, 96)), ("block", (32, 32))])
def test_fp8_weights_become_blocks_that_dequantize_to_the_reference(scheme, block):
    """Every e4m3 code (NaN aside) once at least, each scale granularity: the blocks widen to
    torch's `codes.float() * scale` bit for bit; products of 1, 5 and 40 rows (the kernel's
    and the sliced path) equal the dequantized float product."""
    from workers.quant.fp8_blocks import fp8_blocks

    weight = random_weight(72, 320, seed=5)
    quantized, scale, expanded = quantize_fp8(weight, scheme, block or (128, 128))
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # 0x7f / 0xff are e4m3fn's NaN
    quantized.view(-1)[:codes.numel()] = codes
    packed = fp8_blocks(quantized, scale, block)
    reference = quantized.float() * expanded
    layer = QuantizedLinear(packed, kernels(), None, torch.float32, "int8x2")
    assert torch.equal(layer.dequantized(), reference)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x), x @ reference.t(), rtol=1e-4, atol=1e-4)


def test_fp8_blocks_refuse_what_they_cannot_hold_exactly():
    from workers.quant.fp8_blocks import fp8_blocks

    quantized, scale, _ = quantize_fp8(random_weight(64, 128), "block", (64, 16))
    assert fp8_blocks(quantized, scale, (64, 16)) is None  # 16-wide scale blocks split a block of 32
    quantized, scale, _ = quantize_fp8(random_weight(64, 128), "block", (64, 48))
    assert fp8_blocks(quantized, scale, (64, 48)) is None  # a block of 32 would span two scales
    assert fp8_blocks(quantized, scale, (32, 32)) is None  # scales of another shape
    quantized, scale, _ = quantize_fp8(random_weight(64, 112), "channel")
    assert fp8_blocks(quantized, scale) is None  # 112 inputs: not whole blocks
    quantized, scale, _ = quantize_fp8(random_weight(64, 128), "channel")
    assert fp8_blocks(quantized.to(torch.float8_e5m2), scale) is None  # e5m2 stays float
    assert fp8_blocks(quantized, scale[:3]) is None


def test_int4_groups_smaller_than_a_block_are_not_packed():
    from workers.quant.int4_blocks import int4_blocks

    groups = gptq_groups(256, 16, act_order=False)
    q, zeros, scales, _ = quantize_int4(random_weight(48, 256), groups)
    assert int4_blocks(q, zeros, scales, groups) is None  # a block of 32 inputs would span two groups


@pytest.mark.skipif(kernels() is None, reason="no C compiler to build the quantized kernels")
@pytest.mark.parametrize("method", ["awq", "gptq", "fp8"])
def test_a_tensor_parallel_shard_keeps_its_part_of_the_weights_packed(float_dir, tmp_path, method):
    """Each of two shards holds its rows (q/k/v, gate/up) and input columns (o, down) of the
    quantized weights, equal to the float shard's; GPTQ's act-order inputs cannot be cut by
    column, so o and down stay float there."""
    from workers.contract.model_config import ModelConfig
    from workers.serving.model_part import load_part

    model_dir = tmp_path / f"tiny-{method}"
    quantize_model(float_dir, method, model_dir, tmp_path / "twin")
    for rank in (0, 1):
        shards = {quantization: load_part(ModelConfig(
            id="m", source=str(model_dir), dtype="float32", pack_cpu_weights=False, cache_dir=str(tmp_path / "c"),
            quantization=quantization, quantized_activations="float32", parallel={"tensor_parallel_size": 2}),
            rank)[0].model for quantization in ("auto", "none")}
        floats = dict(shards["none"].named_modules())
        packed = {name: m for name, m in shards["auto"].named_modules() if isinstance(m, QuantizedLinear)}
        layers = shards["auto"].config.num_hidden_layers
        assert len(packed) == (2 if method == "gptq" else 4) * layers
        for name, layer in packed.items():
            assert torch.equal(layer.dequantized(), floats[name].weight), name
