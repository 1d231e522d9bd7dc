"""The worker deployment of an encoder (`runner: pooling`): one replica owns one device and
one embedding model, and answers the worker contract's embedding and tokenizer calls
(embed, tokenize, detokenize, info, stats, health) as a generating model's replica does;
its inputs are batched by workers/serving/encoder_batches.py instead of the engine."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import torch
from ray import serve

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.embeddings import EmbedRequest, EmbedResult
from workers.contract.engine_load import EngineLoad
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest
from workers.contract.serve_logs import route_to_serve_log
from workers.contract.tokenize import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)
from workers.contract.transport import ChannelBatch, ChannelEndpoint
from workers.contract.worker_info import ModelInfo, WorkerStats
from workers.model.encoder import EncoderModel, load_encoder
from workers.serving.cpu_budget import cpu_budget
from workers.serving.embeddings import Embeddings
from workers.serving.encoder_batches import EncoderBatches
from workers.serving.request_trace import WorkerTracing
from workers.serving.tokenization import Tokenization
from workers.text.prompts import PromptBuilder

logger = logging.getLogger(__name__)


def _load_on_this_thread(config: ModelConfig) -> EncoderModel:
    """Load the encoder on the thread that will run it: torch's CPU threads are set per
    calling thread (OpenMP), so they are set where the batches run."""
    if config.device == "cpu":
        torch.set_num_threads(config.engine.torch_threads or cpu_budget())
    return load_encoder(config)


@serve.deployment(name="EncoderWorker", health_check_period_s=10, health_check_timeout_s=30)
class EncoderWorker:
    def __init__(self, model_config: dict, prefill=None, side: str = "colocated",
                 tracing: dict | None = None) -> None:
        """The arguments of ModelWorker's (app.py binds either the same way); an encoder
        has no prefill side."""
        route_to_serve_log(logging.getLogger("workers"))
        self.config = ModelConfig.model_validate(model_config)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="encoder")
        self.encoder = self._executor.submit(_load_on_this_thread, self.config).result()
        engine = self.config.engine
        self.batches = EncoderBatches(self.encoder.pool, self._executor, self.encoder.max_input_tokens,
                                      engine.max_num_seqs, engine.max_num_batched_tokens)
        pooler = self.config.pooler_config.model_copy(update={"pooling_type": self.encoder.pooling})
        worker_tracing = WorkerTracing.from_config(tracing, self.config.id, side)
        tokenizer = self.encoder.tokenizer
        self.embeddings = Embeddings(self.batches, tokenizer, pooler, self.encoder.hidden_size, tracing=worker_tracing)
        self.tokenization = Tokenization(tokenizer, PromptBuilder(tokenizer), self.encoder.max_input_tokens)
        self._active = 0
        logger.info("encoder %s ready: %s", self.config.id, self.info())

    async def embed(self, request: EmbedRequest) -> EmbedResult | ErrorInfo:
        """POST /v1/embeddings: the inputs' vectors, batched with other requests' inputs."""
        self._active += 1
        try:
            return await self.embeddings.embed(request)
        finally:
            self._active -= 1

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult | ErrorInfo:
        return await asyncio.to_thread(self.tokenization.tokenize, request)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult | ErrorInfo:
        return await asyncio.to_thread(self.tokenization.detokenize, request)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[GenerationChunk]]:
        """Refused (the ingress refuses first: its config names the model's runner)."""
        yield [GenerationChunk(error=ErrorInfo(400, f"model: `{self.config.id}` is an embedding model; it serves "
                                                    "/v1/embeddings, not generation", param="model"))]

    async def channel(self, ingress_id: str, replica: str | None = None,
                      socket: bool = False) -> AsyncIterator[ChannelBatch | ChannelEndpoint]:
        """Every ingress opens a channel to each worker replica; an encoder never streams on
        it, so it is only held open (until the ingress cancels it or this replica stops)."""
        await asyncio.Event().wait()
        yield []  # never reached: makes this an async generator, as Serve streams it

    def info(self) -> ModelInfo:
        return ModelInfo(id=self.config.id, max_model_len=self.encoder.max_input_tokens,
                         vocab_size=len(self.encoder.tokenizer), kv_cache_blocks=0, block_size=0,
                         dtype=self.encoder.dtype)

    def stats(self, replica: str | None = None) -> WorkerStats:
        """`replica` pins the call to one replica (the router reads it)."""
        batches = self.batches
        return WorkerStats(active_requests=self._active, waiting=batches.waiting, running=batches.running,
                           kv_blocks_used=0, kv_blocks_total=0, engine_steps=batches.steps, pid=os.getpid(),
                           queued_prompt_tokens=batches.queued_tokens)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The engine-load policy's signals (no KV pool: its usage is 0)."""
        return EngineLoad(self.batches.waiting, 0.0, self.batches.queued_tokens).as_metrics()

    async def check_health(self) -> None:
        if not self.batches.alive:
            raise RuntimeError("the encoder's batching loop is not running")
        stuck = self.batches.stuck_for()
        if stuck > self.config.engine.step_hang_timeout_s:
            raise RuntimeError(f"encoder batch running for {stuck:.0f} s: the model is hung")

    def __del__(self) -> None:
        executor = getattr(self, "_executor", None)
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)
