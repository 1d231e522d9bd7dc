"""The engine's device half, built from its limits: the KV pool, the model runner with its
decode path (the Triton kernel and CUDA graphs on CUDA, the C kernel on CPU), and the grammar decoder."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from workers.core.adapter_slots import AdapterSlots, NoAdapters
from workers.core.limits import EngineLimits
from workers.engine.block_manager import BlockManager
from workers.lora.manager import LoraManager
from workers.model.cpu_attention import cpu_decode_attention
from workers.model.cuda_graphs import DecodeGraphs
from workers.model.direct_forward import direct_forward_for
from workers.model.kv_cache import KVCacheShape, PagedKVCache
from workers.model.loader import weight_bytes
from workers.model.runner import ModelRunner
from workers.model.triton_attention import triton_available
from workers.parallel.driver import DriverForward
from workers.parallel.pipeline import StageLayers
from workers.parallel.shard_group import ShardGroup
from workers.parallel.shard_loop import shard_kv_shape, shard_lora, split_forward
from workers.sampling.guided import GuidedDecoder
from workers.speculative.draft_proposer import DraftProposer
from workers.speculative.ngram_proposer import NgramProposer
from workers.speculative.proposals import ROW_COST, Proposer
from workers.speculative.response_history import ResponseHistory

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodePath:
    triton: bool  # decode rows run the paged Triton kernel
    graphs: bool  # decode steps replay CUDA graphs (they need the Triton kernel)
    direct: bool = False  # Llama-shaped models run chatserve's own forward (direct_forward.py)
    cpu_kernel: bool = False  # decode rows run the paged C kernel (cpu_attention.c)


def kv_pool(model: torch.nn.Module, limits: EngineLimits, world: int = 1,
            stage: StageLayers | None = None) -> tuple[KVCacheShape, int]:
    """The model's KV shape (of one shard's KV heads, split over `world`, or of a pipeline
    stage's layers) and how many blocks the budget holds (at least one, or ValueError)."""
    shape = shard_kv_shape(model, world, stage)
    num_blocks = shape.num_blocks_for_budget(limits.kv_cache_bytes, limits.block_size)
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache budget {limits.kv_cache_bytes} bytes holds no block of {limits.block_size} "
            f"tokens at {shape.bytes_per_token} bytes per token"
        )
    return shape, num_blocks


def decode_path(device: torch.device, limits: EngineLimits, split: bool = False) -> DecodePath:
    """`split`: the model is split over shards (workers/parallel/), which only the direct
    forward runs (no CUDA graphs: their replay would skip the collectives)."""
    triton_decode = device.type == "cuda" and triton_available()
    use_graphs = device.type == "cuda" and limits.cuda_graph_max_batch > 0 and not split
    if use_graphs and not triton_decode:
        logger.warning("CUDA graphs need the Triton decode kernel (triton not importable): decode runs eager")
        use_graphs = False
    # CPU only: what it saves is Python and dispatch time, which CUDA graphs already
    # take out of a GPU's decode steps (and it has not been measured on a GPU).
    direct = (device.type == "cpu" or split) and limits.direct_forward
    cpu_kernel = device.type == "cpu" and cpu_decode_attention() is not None
    return DecodePath(triton_decode, use_graphs, direct, cpu_kernel)


def adapter_slots(model: torch.nn.Module, limits: EngineLimits, shard_group: ShardGroup | None = None,
                  stage: StageLayers | None = None) -> AdapterSlots:
    """The model's LoRA layers and slots when `limits.lora` is set (on a tensor shard's part
    of a split model, or its first pipeline stage, they hold that part of each adapter)."""
    if limits.lora is None:
        return NoAdapters()
    if shard_group is None:
        return LoraManager(model, limits.lora)
    return shard_lora(model, limits.lora, shard_group, stage)


def model_runner(model: torch.nn.Module, kv_cache: PagedKVCache, device: torch.device, path: DecodePath,
                 limits: EngineLimits, vocab_size: int, lora: AdapterSlots = NoAdapters(),
                 shard_group: ShardGroup | None = None, stage: StageLayers | None = None) -> ModelRunner:
    """The runner, with its decode graphs captured when `path` says so (with and without
    LoRA rows when `lora` has slots). `shard_group`: `model` is this driver's part of a
    split model (workers/parallel/), which the direct forward runs over the group: its
    tensor shard, or its first pipeline `stage` (itself split by tensors or not)."""
    runner = ModelRunner(model, kv_cache, device, triton_decode=path.triton, lora=lora, cpu_decode=path.cpu_kernel,
                         deterministic=limits.deterministic)
    if shard_group is not None:
        if not path.direct:
            raise ValueError("a model split over shards runs the direct forward only "
                             "(engine.direct_forward is off)")
        lora_context = lora.context if isinstance(lora, LoraManager) else None
        driver = DriverForward(split_forward(model, shard_group, stage, lora_context), shard_group)
        if lora_context is not None:  # the shards write each adapter and run each step's rows too
            driver.lora_context = lora_context
            lora.on_load = driver.record_lora_load
        runner.direct = driver
    elif path.direct:
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


def proposer(limits: EngineLimits, model: torch.nn.Module, draft: torch.nn.Module | None, num_blocks: int,
             device: torch.device) -> Proposer | None:
    """Speculative decoding's proposer: none, the ngram lookup (suffix: with earlier answers), or the `draft` model over a
    KV pool of its own with `num_blocks` blocks (the target's count: a draft never runs out
    before its target)."""
    spec = limits.speculative
    if spec is None:
        return None
    if spec.method == "suffix":
        return NgramProposer(spec, ResponseHistory(spec.lookup_max, spec.history_requests))
    if spec.method != "draft":
        return NgramProposer(spec)
    if draft is None:
        raise ValueError("speculative.method 'draft' needs the draft model")
    vocab, draft_vocab = model.get_output_embeddings().weight.shape[0], draft.get_output_embeddings().weight.shape[0]
    if draft_vocab > vocab:  # its proposals must be ids the target embeds
        raise ValueError(f"speculative.draft_source: the draft's vocabulary ({draft_vocab}) is larger than the "
                         f"model's ({vocab}); a draft needs the model's tokenizer")
    plain = dataclasses.replace(limits, lora=None, cuda_graph_max_batch=0, speculative=None)
    kv_cache = PagedKVCache(shard_kv_shape(draft, 1), num_blocks, limits.block_size, device)
    runner = model_runner(draft, kv_cache, device, decode_path(device, plain), plain, draft_vocab)
    blocks = BlockManager(num_blocks, limits.block_size, enable_prefix_caching=False)
    share = draft_step_share(draft, model)  # a draft step, as a share of a target step
    if ROW_COST + share >= 1:  # every token passes through the draft once, proposed after or not
        logger.warning("the draft model reads %.0f%% of the model's weight bytes a step: it cannot make decoding "
                       "faster (a draft pays at a few percent)", 100 * share)
    return DraftProposer(spec, runner, blocks, share, limits.max_num_batched_tokens)


def draft_step_share(draft: torch.nn.Module, model: torch.nn.Module) -> float:
    """A draft step's cost as a share of a target step, estimated by the bytes of weights
    each step reads (decode steps at small batches are bound by those)."""
    return weight_bytes(draft) / weight_bytes(model)
