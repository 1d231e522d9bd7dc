"""Load GPTQ, AWQ and FP8 checkpoints by dequantizing them once into a plain float directory.

transformers loads these formats only through optimum/gptqmodel/autoawq (or FP8 kernels)
that the project does not ship, so such a source would not load at all. Like a GGUF file
(workers/model/loader.py), the checkpoint is converted once: its quantized linear weights
are dequantized to the dtype its config names, every other tensor is copied as is, and
the result is saved under the model cache as safetensors with the config minus its
`quantization_config`. Later starts load that copy; a file lock keeps two replicas on one
machine from converting at the same time.

The packed layouts (4-bit only for GPTQ and AWQ):
- GPTQ: `qweight` int32 [in/8, out], 8 nibbles along the input dim (nibble k of row r is
  input row 8r+k); `qzeros` int32 [groups, out/8], nibbles along the output dim, stored as
  zero-1 in the v1 `checkpoint_format` ("gptq", the default) and as the zero in "gptq_v2";
  `scales` [groups, out]; `g_idx` [in], the group of each input row (any order with
  act-order). W[j, i] = scales[g, j] * (q[i, j] - z[g, j]) with g = g_idx[i].
- AWQ (GEMM): `qweight` int32 [in, out/8] and `qzeros` int32 [groups, out/8], both packed
  along the output dim in AWQ's interleaved order (nibble k holds column AWQ_ORDER[k] of
  its 8); zeros stored as is. W[j, i] = (q[i, j] - z[g, j]) * scales[g, j], g = i // group.
- FP8: `weight` float8 [out, in] times `weight_scale_inv` block scales (the config's
  `weight_block_size`, edge blocks partial) or `weight_scale` per tensor or per row;
  activation scales (`input_scale`, ...) are dropped.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from workers.model.model_cache import converted_once, source_identity

SUPPORTED_METHODS = ("gptq", "awq", "fp8")
GPTQ_FORMATS = ("gptq", "gptq_v2")
# AWQ packs the 8 columns of each int32 in this order: nibble k holds column AWQ_ORDER[k].
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]  # column c is nibble AWQ_REVERSE_ORDER[c]
# Activation and KV-cache scales of FP8 checkpoints: meaningless once the weights are float.
FP8_DROPPED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale", ".q_scale", ".kv_scale")
# Files that describe the quantization only (AutoGPTQ's and AutoAWQ's side files): not copied.
QUANTIZATION_SIDE_FILES = ("quantize_config.json", "quant_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 2 * 1024**3
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # nibble k of an int32 sits at bit 4k


def _read_config(model_dir: Path) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def quantization_method(model_dir: Path) -> str | None:
    """The quantization `model_dir`'s config declares when it is one this module dequantizes
    (lower-case), None for a plain checkpoint; a ValueError for any other quantization or
    packing, raised before anything is converted or cached."""
    settings = _read_config(model_dir).get("quantization_config")
    if not settings:
        return None
    method = str(settings.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"model source {str(model_dir)!r}: quantization {method!r} is not supported "
                         f"({', '.join(SUPPORTED_METHODS)} load dequantized)")
    _check_settings(model_dir, method, settings)
    return method


def _check_settings(model_dir: Path, method: str, settings: dict) -> None:
    """Refuse the variants of a supported method whose packing is not the one implemented here."""
    where = f"model source {str(model_dir)!r} ({method})"
    if method in ("gptq", "awq"):
        bits = settings.get("bits", settings.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{where}: quantization_config.bits={bits!r} is not supported (4 only)")
    if method == "gptq":
        fmt = settings.get("checkpoint_format") or "gptq"
        if fmt not in GPTQ_FORMATS:
            raise ValueError(f"{where}: quantization_config.checkpoint_format={fmt!r} is not supported "
                             f"({', '.join(GPTQ_FORMATS)} only)")
    if method == "awq":
        version = str(settings.get("version") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"{where}: quantization_config.version={version!r} is not supported (gemm only)")
        if settings.get("zero_point") is False:
            raise ValueError(f"{where}: quantization_config.zero_point=false is not supported")


# The pure dequantization rules, one per format.

def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[r, c] int32 holding 8 nibbles each along dim 0 -> [8r, c] values 0..15 (GPTQ qweight)."""
    nibbles = (packed.to(torch.int32).unsqueeze(1) >> _SHIFTS.view(1, 8, 1)) & 0xF  # [r, 8, c]
    return nibbles.reshape(packed.shape[0] * 8, packed.shape[1])


def unpack_int4_columns(packed: torch.Tensor) -> torch.Tensor:
    """[r, c] int32 holding 8 nibbles each along dim 1, nibble k = column 8b+k -> [r, 8c]."""
    nibbles = (packed.to(torch.int32).unsqueeze(-1) >> _SHIFTS) & 0xF  # [r, c, 8]
    return nibbles.reshape(packed.shape[0], packed.shape[1] * 8)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[r, c] int32 in AWQ's interleaved column order -> [r, 8c] in natural column order."""
    rows = packed.shape[0]
    return unpack_int4_columns(packed).view(-1, 8)[:, AWQ_REVERSE_ORDER].reshape(rows, -1)


def dequantize_gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                    g_idx: torch.Tensor | None, group_size: int, zero_offset: int = 1) -> torch.Tensor:
    """A GPTQ 4-bit linear's float32 weight [out, in]. `zero_offset`: 1 for the v1 format,
    which stores zero-1 (added without wrapping, as GPTQ's own kernels do), 0 for gptq_v2.
    `g_idx` None: consecutive groups of `group_size` rows (-1: one group)."""
    q = unpack_int4_rows(qweight)  # [in, out]
    z = unpack_int4_columns(qzeros) + zero_offset  # [groups, out]
    in_features = q.shape[0]
    if g_idx is None:
        step = in_features if group_size == -1 else group_size
        g_idx = torch.arange(in_features) // step
    g_idx = g_idx.long()
    if g_idx.shape != (in_features,) or scales.shape != z.shape or scales.shape[1] != q.shape[1]:
        raise ValueError(f"GPTQ shapes do not match: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, g_idx {tuple(g_idx.shape)}")
    weight_t = scales.float()[g_idx] * (q - z[g_idx]).float()  # [in, out]
    return weight_t.t().contiguous()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """An AWQ (GEMM) 4-bit linear's float32 weight [out, in]; zeros are stored as is."""
    q = unpack_awq(qweight)  # [in, out]
    z = unpack_awq(qzeros)  # [groups, out]
    in_features = q.shape[0]
    step = in_features if group_size == -1 else group_size
    groups = torch.arange(in_features) // step
    if scales.shape != z.shape or scales.shape[1] != q.shape[1] or int(groups[-1]) >= scales.shape[0]:
        raise ValueError(f"AWQ shapes do not match: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)}, group_size {group_size}")
    weight_t = (q - z[groups]).float() * scales.float()[groups]  # [in, out]
    return weight_t.t().contiguous()


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block_size: tuple[int, int] | list[int] | None = None) -> torch.Tensor:
    """An FP8 linear's float32 weight [out, in]. `block_size` [B0, B1]: `scale` holds one
    factor per block [ceil(out/B0), ceil(in/B1)], edge blocks partial. Otherwise `scale` is
    per tensor (a scalar or [1]) or per output row ([out] or [out, 1])."""
    out_features, in_features = weight.shape
    scale = scale.float()
    if block_size is not None:
        rows, cols = block_size
        expected = (-(-out_features // rows), -(-in_features // cols))
        if tuple(scale.shape) != expected:
            raise ValueError(f"FP8 block scales {tuple(scale.shape)} do not fit weight {tuple(weight.shape)} "
                             f"in blocks of {list(block_size)} (expected {expected})")
        scale = scale.repeat_interleave(rows, 0)[:out_features].repeat_interleave(cols, 1)[:, :in_features]
    elif scale.numel() == 1:
        scale = scale.reshape(())
    elif scale.numel() == out_features:
        scale = scale.reshape(out_features, 1)
    else:
        raise ValueError(f"FP8 scale of shape {tuple(scale.shape)} fits neither per-tensor nor per-channel "
                         f"scaling of weight {tuple(weight.shape)} (and the config gives no weight_block_size)")
    return weight.float() * scale


# The conversion of a whole checkpoint.

def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files that make up the checkpoint: the index's shards, else
    model.safetensors, else every *.safetensors (a side file such as Mistral's
    consolidated.safetensors next to an index is not read twice)."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / name for name in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    return sorted(model_dir.glob("*.safetensors"))


def target_dtype(config: dict) -> torch.dtype:
    """The dtype the config says the model runs in (`dtype`, or `torch_dtype` of older
    configs); bfloat16 when it names none (or "auto")."""
    name = config.get("dtype") or config.get("torch_dtype")
    return _DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)


def _dequantized_tensors(method: str, settings: dict, keys: dict[str, Callable[[], torch.Tensor]],
                         dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of the float checkpoint, in the source's order: each quantized module's
    weight dequantized when its first tensor is reached, its companion tensors left out."""
    done: set[str] = set()
    if method in ("gptq", "awq"):
        group_size = int(settings.get("group_size", settings.get("q_group_size", 128)))
        zero_offset = 0 if settings.get("checkpoint_format") == "gptq_v2" else 1
        modules = {key.removesuffix(".qweight") for key in keys if key.endswith(".qweight")}
        parts = ("qweight", "qzeros", "scales", "g_idx")
        for key, read in keys.items():
            prefix, _, part = key.rpartition(".")
            if prefix not in modules or part not in parts:
                yield key, read()
                continue
            if prefix in done:
                continue
            done.add(prefix)
            qweight, qzeros, scales = (keys[f"{prefix}.{name}"]() for name in parts[:3])
            if method == "gptq":
                g_idx = keys[f"{prefix}.g_idx"]() if f"{prefix}.g_idx" in keys else None
                weight = dequantize_gptq(qweight, qzeros, scales, g_idx, group_size, zero_offset)
            else:
                weight = dequantize_awq(qweight, qzeros, scales, group_size)
            yield f"{prefix}.weight", weight.to(dtype)
        return
    block = settings.get("weight_block_size")
    for key, read in keys.items():
        if key.endswith(FP8_DROPPED_SUFFIXES):
            continue
        prefix, _, part = key.rpartition(".")
        if part in ("weight_scale_inv", "weight_scale") and f"{prefix}.weight" in keys:
            continue  # consumed with its weight
        tensor = read()
        if part != "weight" or tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            yield key, tensor
            continue
        if f"{prefix}.weight_scale_inv" in keys:
            if block is None:
                raise ValueError(f"{key}: block scales (weight_scale_inv) but no quantization_config.weight_block_size")
            weight = dequantize_fp8(tensor, keys[f"{prefix}.weight_scale_inv"](), block)
        elif f"{prefix}.weight_scale" in keys:
            weight = dequantize_fp8(tensor, keys[f"{prefix}.weight_scale"]())
        else:
            raise ValueError(f"{key}: an FP8 weight with neither weight_scale_inv nor weight_scale")
        yield key, weight.to(dtype)


def _write_shards(tensors: Iterator[tuple[str, torch.Tensor]], target: Path, max_shard_bytes: int) -> None:
    """Save the tensors as safetensors shards of at most `max_shard_bytes` (a single tensor
    larger than that gets its own): one model.safetensors, or numbered shards and an index."""
    shards: list[list[str]] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        shards.append(list(pending))
        save_file(pending, str(target / f"shard-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        pending, pending_bytes = {}, 0

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            flush()
        pending[name] = tensor.contiguous()
        pending_bytes += size
        total += size
    if pending or not shards:
        flush()
    if len(shards) == 1:
        (target / "shard-00001.safetensors").rename(target / "model.safetensors")
        return
    weight_map = {}
    for number, names in enumerate(shards, 1):
        final = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        (target / f"shard-{number:05d}.safetensors").rename(target / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (target / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def dequantize_checkpoint(model_dir: Path, target: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the float twin of the quantized checkpoint in `model_dir` at `target`: weights
    read tensor by tensor (memory-mapped, one output shard held at a time), config.json
    without `quantization_config`, the other non-weight files copied (model_cache.py
    writes it into a temporary directory and renames it)."""
    method = quantization_method(model_dir)
    if method is None:
        raise ValueError(f"model source {str(model_dir)!r} is not quantized (no quantization_config)")
    config = _read_config(model_dir)
    settings = config.pop("quantization_config")
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"model source {str(model_dir)!r} ({method}): no safetensors weights")
    target.mkdir(parents=True)
    with ExitStack() as stack:
        keys: dict[str, Callable[[], torch.Tensor]] = {}
        for file in files:
            handle = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            for key in handle.keys():
                keys[key] = lambda handle=handle, key=key: handle.get_tensor(key)
        _write_shards(_dequantized_tensors(method, settings, keys, target_dtype(config)), target, max_shard_bytes)
    (target / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for file in sorted(model_dir.iterdir()):
        skip = file.name in ("config.json", INDEX_NAME, *QUANTIZATION_SIDE_FILES) or file.name.endswith(WEIGHT_SUFFIXES)
        if file.is_file() and not skip:
            shutil.copy2(file, target / file.name)


def dequantized_model_dir(model_dir: Path, method: str, cache_dir: Path) -> Path:
    """The float copy of the quantized `model_dir` under `cache_dir`, converted on the first
    call only; keyed by the weights' total size and newest mtime, so a changed checkpoint
    converts anew and its older copy goes (workers/model/model_cache.py: one conversion,
    under a file lock)."""
    files = weight_files(model_dir)
    if not files:
        raise FileNotFoundError(f"model source {str(model_dir)!r} ({method}): no safetensors weights")
    return converted_once(cache_dir, f"{model_dir.name}-{method}", source_identity([file.stat() for file in files]),
                          model_dir, lambda directory: dequantize_checkpoint(model_dir, directory),
                          f"the {method} checkpoint {model_dir}")
