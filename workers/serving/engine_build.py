"""Building a worker's engine from its model config: load the model, size the KV pool,
find the end-of-sequence ids; and the prompt builder of a vision-language model."""

from __future__ import annotations

from pathlib import Path

import torch

from workers.contract.model_config import ModelConfig
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.loader import LoadedModel, load_model
from workers.serving.cpu_budget import cpu_budget
from workers.serving.host_memory import keep_freed_memory
from workers.text.vision_prompts import VisionPromptBuilder


def build_engine(config: ModelConfig) -> tuple[LLMEngine, LoadedModel]:
    """Load the model and build its engine. Call it on the thread that will run the engine
    (AsyncEngine.start_on_own_thread says why)."""
    _set_torch_threads(config)
    if config.device == "cpu":
        keep_freed_memory()
    attn = register_paged_attention()
    cache_dir = Path(config.cache_dir) if config.cache_dir else None
    loaded = load_model(config.source, config.device, config.dtype, cache_dir, attn_implementation=attn,
                        pack_cpu_weights=config.pack_cpu_weights, fuse_projections=config.fuse_projections)
    device = torch.device(config.device)
    limits = sized_engine_limits(config, loaded.model, device)
    eos = eos_token_ids(loaded)
    return LLMEngine(loaded.model, eos, limits, device, tokenizer=loaded.tokenizer), loaded


def vision_prompts(loaded: LoadedModel, config: ModelConfig) -> VisionPromptBuilder | None:
    """The prompt builder of a vision-language model (None for a text model)."""
    if loaded.processor is None:
        return None
    return VisionPromptBuilder(loaded.processor, loaded.image_token_id, config.max_image_pixels)


def eos_token_ids(loaded: LoadedModel) -> frozenset[int]:
    """Every end-of-sequence id the model's generation config, config or tokenizer names."""
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _set_torch_threads(config: ModelConfig) -> None:
    # Ray sets OMP_NUM_THREADS=1 inside actors; on CPU that would halve throughput. The
    # default is the CPUs the container may use (its CPU quota), not the node's cores.
    if config.device == "cpu":
        threads = config.engine.torch_threads or cpu_budget()
        torch.set_num_threads(threads)
