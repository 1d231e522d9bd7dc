"""The engine's device half, built from its limits: the KV pool, the model runner with its
decode path (the Triton kernel and CUDA graphs on CUDA), and the grammar decoder."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from workers.core.adapter_slots import AdapterSlots, NoAdapters
from workers.core.limits import EngineLimits
from workers.model.cuda_graphs import DecodeGraphs
from workers.model.direct_forward import direct_forward_for
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.runner import ModelRunner
from workers.model.triton_attention import triton_available
from workers.sampling.guided import GuidedDecoder

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodePath:
    triton: bool  # decode rows run the paged Triton kernel
    graphs: bool  # decode steps replay CUDA graphs (they need the Triton kernel)
    direct: bool = False  # Llama-shaped models run chatserve's own forward (direct_forward.py)


def kv_pool(model: torch.nn.Module, limits: EngineLimits) -> tuple[KVCacheShape, int]:
    """The model's KV shape and how many blocks the budget holds (at least one, or ValueError)."""
    shape = KVCacheShape.from_model_config(model.config, model.dtype)
    num_blocks = shape.num_blocks_for_budget(limits.kv_cache_bytes, limits.block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache budget {limits.kv_cache_bytes} bytes holds no block of {limits.block_size} "
            f"tokens at {shape.bytes_per_token} bytes per token"
        )
    return shape, num_blocks


def decode_path(device: torch.device, limits: EngineLimits) -> DecodePath:
    triton_decode = device.type == "cuda" and triton_available()
    use_graphs = device.type == "cuda" and limits.cuda_graph_max_batch > 0
    if use_graphs and not triton_decode:
        logger.warning("CUDA graphs need the Triton decode kernel (triton not importable): decode runs eager")
        use_graphs = False
    # CPU only: what it saves is Python and dispatch time, which CUDA graphs already
    # take out of a GPU's decode steps (and it has not been measured on a GPU).
    direct = device.type == "cpu" and limits.direct_forward and limits.lora is None
    return DecodePath(triton_decode, use_graphs, direct)


def model_runner(model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device, path: DecodePath,
                 limits: EngineLimits, vocab_size: int, lora: AdapterSlots = NoAdapters()) -> ModelRunner:
    """The runner, with its decode graphs captured when `path` says so (with and without
    LoRA rows when `lora` has slots)."""
    runner = ModelRunner(model, kv_cache, device, triton_decode=path.triton, lora=lora)
    if path.direct:  # never with LoRA (decode_path)
        runner.direct = direct_forward_for(model)
    if path.graphs:
        graphs = DecodeGraphs(model, kv_cache, min(limits.cuda_graph_max_batch, limits.max_num_seqs),
                              limits.max_model_len, vocab_size, lora)
        graphs.capture()
        runner.decode_graphs = graphs
    return runner


def guided_decoder(tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> GuidedDecoder | None:
    if tokenizer is None:
        return None
    try:
        return GuidedDecoder(tokenizer, vocab_size, eos_token_ids)
    except ValueError:  # llguidance reads fast (Rust) tokenizers only
        logger.warning("guided decoding is off: %s is not a fast tokenizer", type(tokenizer).__name__)
        return None
