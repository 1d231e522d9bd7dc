"""The Ray Serve model-worker deployment: one replica owns one device and one engine."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import torch
from ray import serve

from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest
from workers.contract.serve_logs import route_to_serve_log
from workers.contract.worker_info import ModelInfo, WorkerStats
from workers.engine.kv_sizing import sized_engine_limits
from workers.engine.llm_engine import LLMEngine
from workers.model.attention import register_paged_attention
from workers.model.cpu_linear import PackedLinear
from workers.model.fused_projections import FusedProjection
from workers.model.loader import LoadedModel, load_model
from workers.serving.async_engine import AsyncEngine
from workers.serving.host_memory import keep_freed_memory
from workers.serving.request_processor import RequestProcessor, Timeouts
from workers.text.vision_prompts import VisionPromptBuilder

logger = logging.getLogger(__name__)


def _set_torch_threads(config: ModelConfig) -> None:
    # Ray sets OMP_NUM_THREADS=1 inside actors; on CPU that would halve throughput.
    if config.device == "cpu":
        threads = config.engine.torch_threads or os.cpu_count() or 1
        torch.set_num_threads(threads)


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


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
    eos = _eos_token_ids(loaded)
    return LLMEngine(loaded.model, eos, limits, device, tokenizer=loaded.tokenizer), loaded


def _vision_prompts(loaded: LoadedModel, config: ModelConfig) -> VisionPromptBuilder | None:
    if loaded.processor is None:
        return None
    return VisionPromptBuilder(loaded.processor, loaded.image_token_id, config.max_image_pixels)


def _eos_token_ids(loaded) -> frozenset[int]:
    ids: set[int] = set()
    for source in (loaded.model.generation_config, loaded.model.config, loaded.tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


@serve.deployment(name="ModelWorker", health_check_period_s=10, health_check_timeout_s=30)
class ModelWorker:
    def __init__(self, model_config: dict) -> None:
        route_to_serve_log(logging.getLogger("workers"))  # the ready line, the packing probe, engine errors
        self.config = ModelConfig.model_validate(model_config)
        models: list[LoadedModel] = []

        def build() -> LLMEngine:
            engine, loaded = build_engine(self.config)
            models.append(loaded)
            return engine

        self.engine = AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())
        loaded = models[0]
        engine_config = self.config.engine
        timeouts = Timeouts(engine_config.first_token_timeout_s, engine_config.request_timeout_s)
        vision = _vision_prompts(loaded, self.config)
        self.processor = RequestProcessor(self.engine, loaded.tokenizer, timeouts, vision,
                                          stream_interval=engine_config.stream_interval)
        logger.info("model %s ready: %s", self.config.id, self.info())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        async for chunk in self.processor.generate(request):
            yield chunk

    def info(self) -> ModelInfo:
        core = self.engine.engine
        return ModelInfo(
            id=self.config.id,
            max_model_len=core.limits.max_model_len,
            vocab_size=core.vocab_size,
            kv_cache_blocks=core.blocks.num_blocks,
            block_size=core.blocks.block_size,
            accepts_images=self.processor.vision is not None,
            dtype=str(core.runner.model.dtype).removeprefix("torch."),
            packed_linear_layers=sum(isinstance(m, PackedLinear) for m in core.runner.model.modules()),
            fused_projections=sum(isinstance(m, FusedProjection) for m in core.runner.model.modules()),
            decode_attention="triton" if core.runner.triton_decode else "sdpa",
            cuda_graph_max_batch=core.runner.decode_graphs.max_batch if core.runner.decode_graphs else 0,
        )

    def stats(self) -> WorkerStats:
        core = self.engine.engine
        return WorkerStats(
            active_requests=core.num_active,
            waiting=len(core.scheduler.waiting),
            running=len(core.scheduler.running),
            kv_blocks_used=core.blocks.num_used_blocks,
            kv_blocks_total=core.blocks.num_blocks,
            engine_steps=self.engine.steps,
            prefix_cache_query_tokens=core.blocks.query_tokens,
            prefix_cache_hit_tokens=core.blocks.hit_tokens,
            pid=os.getpid(),
            rss_bytes=_resident_bytes(),
        )

    def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and replaces it."""
        if not self.engine.alive:
            raise RuntimeError(f"engine thread is not running: {self.engine.error!r}")
        stuck = self.engine.stuck_for()
        if stuck > self.config.engine.step_hang_timeout_s:
            raise RuntimeError(f"engine step running for {stuck:.0f} s: the engine loop is hung")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
