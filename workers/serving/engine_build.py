"""Building a worker's engine from its model config: load the model (or, split over
shards, this replica's part, with the other shards started as Ray actors),
size the KV pool, find the end-of-sequence ids; and the prompt builder of a
vision-language model."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from workers.contract.model_config import ModelConfig
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.loader import LoadedModel
from workers.parallel.shard_group import ShardGroup, free_init_method
from workers.serving.model_part import load_part, shard_layout
from workers.text.vision_prompts import VisionPromptBuilder

logger = logging.getLogger(__name__)


@dataclass
class BuiltEngine:
    engine: LLMEngine
    loaded: LoadedModel  # the whole model, or the driver's part of a split one
    shards: list = field(default_factory=list)  # a split model's other shards (Ray actor handles)


def build_engine(config: ModelConfig) -> BuiltEngine:
    """Load the model and build its engine. Call it on the thread that will run the engine
    (AsyncEngine.start_on_own_thread says why)."""
    device = torch.device(config.device)
    world = config.parallel.shards
    if world == 1:
        loaded, _ = load_part(config, 0)
        limits = sized_engine_limits(config, loaded.model, device)
        engine = LLMEngine(loaded.model, eos_token_ids(loaded), limits, device, tokenizer=loaded.tokenizer,
                           draft_model=load_draft(config, loaded))
        return BuiltEngine(engine, loaded)
    from workers.serving.shard_actors import (  # Ray, in the replica only
        peak_rss_mib,
        start_shards,
    )

    started = time.monotonic()
    init_method = free_init_method(_node_address())
    shards = start_shards(config, init_method)
    loaded, stage = load_part(config, 0)
    group = ShardGroup(0, shard_layout(config), init_method, device)  # waits for every shard to load and join
    limits = sized_engine_limits(config, loaded.model, device)
    engine = LLMEngine(loaded.model, eos_token_ids(loaded), limits, device, tokenizer=loaded.tokenizer,
                       shard_group=group, stage=stage)
    logger.info("%s split over %d shards, ready in %.1f s; the driver's peak RSS %.0f MiB", config.id, world,
                time.monotonic() - started, peak_rss_mib())
    return BuiltEngine(engine, loaded, shards)


def load_draft(config: ModelConfig, target: LoadedModel) -> torch.nn.Module | None:
    """Speculative method 'draft's model, loaded as the target is (device, dtype,
    quantization); a ValueError naming the field when its tokenizer is not the target's."""
    spec = config.speculative
    if spec is None or spec.method != "draft":
        return None
    draft, _ = load_part(config.model_copy(update={"source": spec.draft_source}), 0)
    if not same_tokenizer(draft.tokenizer, target.tokenizer):
        raise ValueError(f"model {config.id!r}: speculative.draft_source: {spec.draft_source!r} has another "
                         "tokenizer than the model's (a draft's proposals are the model's token ids)")
    logger.info("%s: draft model %s loaded", config.id, spec.draft_source)
    return draft.model


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers map the same strings to the same ids (both absent: no way to
    tell, taken as the same)."""
    if a is None or b is None:
        return a is b
    return a.get_vocab() == b.get_vocab()


def _node_address() -> str:
    """This node's address, where shard 0 hosts the group's rendezvous."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


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
