"""The Ray Serve model-worker deployment: one replica owns one device and one engine.

With prefill/decode disaggregation a model has two such deployments: the prefill side's
replicas hand requests over after their first token (keeping the prompt's KV blocks for
`take_kv`), and the decode side's replicas, given the prefill deployment's handle, take
those blocks by a call pinned to the replica that holds them (workers/serving/kv_handoffs.py)."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncIterator

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.embeddings import EmbedRequest, EmbedResult
from workers.contract.engine_load import EngineLoad
from workers.contract.kv_handoff import KVHandoff
from workers.contract.model_config import ModelConfig, PoolerConfig
from workers.contract.requests import GenerateRequest
from workers.contract.serve_logs import route_to_serve_log
from workers.contract.tokenize import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)
from workers.contract.transport import ChannelBatch, ChannelEndpoint, ChannelReceipt
from workers.contract.worker_info import ModelInfo, WorkerStats
from workers.engine.kv_transfer import KVBlocks
from workers.engine.llm_engine import LLMEngine
from workers.lora.replica_adapters import WorkerAdapters
from workers.model.cpu_linear import PackedLinear
from workers.model.fused_projections import FusedProjection
from workers.model.model_kind import own_pooling
from workers.serving.async_engine import AsyncEngine
from workers.serving.channel_socket import ChannelSocket
from workers.serving.channels import ChannelRegistry, until_closed
from workers.serving.embeddings import Embeddings, EnginePooling
from workers.serving.engine_build import BuiltEngine, build_engine, vision_prompts
from workers.serving.kv_handoffs import KVHandoffs
from workers.serving.request_processor import RequestProcessor, Timeouts
from workers.serving.request_trace import WorkerTracing
from workers.serving.tokenization import Tokenization

logger = logging.getLogger(__name__)

SHARD_CHECK_TIMEOUT_S = 10
# Taking a hand-over's blocks: past this the decode replica computes the prompt itself. A
# call pinned to a prefill replica that died waits (Serve retries the pin) until it times
# out, so the bound is short: a fixed part for the call, and time for the bytes at a rate
# well below what the object store moved on 2 busy cores (~150 MB/s, docs/BENCHMARKS.md).
KV_FETCH_BASE_S = 5.0
KV_FETCH_BYTES_PER_S = 20e6


def _end_replica(cause: BaseException) -> None:
    """A split model lost a shard mid-step: end this replica's process now, so that its
    requests' streams break and resume on another replica (an engine that merely stopped
    would answer them with errors), and Serve replaces the replica with all its shards."""
    logger.critical("a shard of the split model was lost (%s: %s): ending this replica", type(cause).__name__, cause)
    logging.shutdown()
    os._exit(70)


def _replica_id() -> str:
    """Serve's unique id of this replica ("" outside Serve)."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a replica (a test building the worker directly)
        return ""


def _node_address() -> str:
    """This node's address as Ray knows it (loopback outside Ray: a test building the worker)."""
    try:
        return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # noqa: BLE001 - no address known: this machine only
        return "127.0.0.1"


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@serve.deployment(name="ModelWorker", health_check_period_s=10, health_check_timeout_s=30)
class ModelWorker:
    def __init__(self, model_config: dict, prefill: DeploymentHandle | None = None, side: str = "colocated",
                 tracing: dict | None = None) -> None:
        """`prefill`: the model's prefill deployment, for a decode replica (disaggregation);
        `side`: colocated, prefill or decode; `tracing`: the app's `server.tracing`
        (workers/contract/tracing.py; None or no endpoint: no spans)."""
        route_to_serve_log(logging.getLogger("workers"))  # the ready line, the packing probe, engine errors
        self.config = ModelConfig.model_validate(model_config)
        built: list[BuiltEngine] = []
        nice = self.config.disaggregation.prefill_nice if side == "prefill" else 0

        def build() -> LLMEngine:
            if nice:
                # This thread only (Linux niceness is per thread): the engine thread and the
                # model threads it starts inherit it; the event loop, which streams first
                # tokens and hands blocks over, keeps its priority. Raised, never lowered
                # (that needs privileges), from what Ray started the process with.
                tid = threading.get_native_id()
                os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
            built.append(build_engine(self.config))
            return built[0].engine

        self.engine = AsyncEngine.start_on_own_thread(build, asyncio.get_running_loop())
        loaded, self._shards = built[0].loaded, built[0].shards
        if self._shards:
            built[0].engine.runner.direct.on_lost = _end_replica
        modules = list(loaded.model.modules())
        self._packed_linear_layers = sum(isinstance(m, PackedLinear) for m in modules)
        self._fused_projections = sum(isinstance(m, FusedProjection) for m in modules)
        engine_config = self.config.engine
        timeouts = Timeouts(engine_config.first_token_timeout_s, engine_config.request_timeout_s)
        self._prefill = prefill
        handoffs = KVHandoffs(self.engine, _replica_id(), self._take_from_prefill if prefill is not None else None)
        worker_tracing = WorkerTracing.from_config(tracing, self.config.id, side)
        self.processor = RequestProcessor(self.engine, loaded.tokenizer, timeouts, vision_prompts(loaded, self.config),
                                          stream_interval=engine_config.stream_interval,
                                          default_max_tokens=self.config.default_max_tokens, handoffs=handoffs,
                                          tracing=worker_tracing)
        self.tokenization = Tokenization(loaded.tokenizer, self.processor.prompts, self.processor.max_model_len,
                                         self.processor.vision)
        hidden_size = loaded.model.config.get_text_config().hidden_size  # a VLM's is its text model's
        pooler = decoder_pooler(self.config.pooler_config, loaded.path)
        self.embeddings = Embeddings(EnginePooling(self.engine, pooler), loaded.tokenizer, pooler, hidden_size,
                                     _embedding_refusal(self._shards, self.processor), tracing=worker_tracing)
        self.channels = ChannelRegistry()
        self.channel_socket = ChannelSocket(self.channels, _node_address())
        self._requests_by_channel = self._requests_by_call = 0
        self.adapters = WorkerAdapters(self.engine, self.config.lora, multiplexed=True)
        self.adapters.check_configured()
        logger.info("model %s ready: %s", self.config.id, self.info())

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[GenerationChunk] | ChannelReceipt]:
        """A request. Its chunks go by its ingress's channel when one is open here (then this
        call ends with a `ChannelReceipt`), else by this call: each message holds everything
        pending when the worker got to send (a backlog is merged per choice, never held for
        a timer). Cancelling the call aborts the request."""
        if request.lora is not None and (error := await self.adapters.ensure(request.lora)) is not None:
            yield [GenerationChunk(error=error)]
            return
        outbox = self.channels.get(request.ingress_id)
        if outbox is None:
            self._requests_by_call += 1
            async for batch in self.processor.stream(request):
                yield batch
            return
        self._requests_by_channel += 1
        await until_closed(outbox, asyncio.create_task(self.processor.run_guarded(request, outbox)))
        yield await outbox.receipt(request.request_id)

    async def channel(self, ingress_id: str, replica: str | None = None,
                      socket: bool = False) -> AsyncIterator[ChannelBatch | ChannelEndpoint]:
        """One ingress replica's channel: the chunks of all its requests here, every message
        holding all that was pending. With `socket`, the one message is where the ingress
        connects for them (workers/serving/channel_socket.py), and the call stays open
        beside that connection (it holds the channel's place among the ongoing requests).
        `replica` pins the call to this replica (the router reads it). Open until the
        ingress cancels it or this replica stops."""
        if socket:
            yield await self.channel_socket.endpoint()
            await asyncio.Event().wait()  # held open until the ingress cancels it
            return
        outbox = self.channels.open(ingress_id)
        try:
            async for batch in outbox.send():
                yield batch
        finally:
            self.channels.close(ingress_id, outbox)

    async def take_kv(self, key: str, held_blocks: int = 0, replica: str | None = None) -> KVBlocks | None:
        """A hand-over's KV blocks, once, for the decode replica going on with the request,
        less the first `held_blocks` it has; `replica` pins the call to this replica (the
        router reads it)."""
        return self.processor.handoffs.take(key, held_blocks)

    async def _take_from_prefill(self, handoff: KVHandoff, held_blocks: int) -> KVBlocks | None:
        call = self._prefill.take_kv.remote(handoff.key, held_blocks, replica=handoff.replica)
        try:
            return await asyncio.wait_for(call, KV_FETCH_BASE_S + handoff.nbytes / KV_FETCH_BYTES_PER_S)
        except TimeoutError:
            call.cancel()
            raise

    async def check_lora_adapter(self, name: str, path: str) -> ErrorInfo | None:
        """For POST /v1/load_lora_adapter: None when `path` holds an adapter this model can
        serve (inside lora.adapter_dir), else the 400 to answer."""
        return await self.adapters.check(name, path)

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResult | ErrorInfo:
        """POST /tokenize: in a thread, so a long prompt never stalls the streams on this loop."""
        return await asyncio.to_thread(self.tokenization.tokenize, request)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResult | ErrorInfo:
        """POST /detokenize (in a thread, as tokenize)."""
        return await asyncio.to_thread(self.tokenization.detokenize, request)

    async def embed(self, request: EmbedRequest) -> EmbedResult | ErrorInfo:
        """POST /v1/embeddings: the inputs' vectors, computed in the engine's batches."""
        return await self.embeddings.embed(request)

    def info(self) -> ModelInfo:
        engine = self.engine.describe()
        return ModelInfo(
            id=self.config.id,
            max_model_len=engine.max_model_len,
            vocab_size=engine.vocab_size,
            kv_cache_blocks=engine.num_blocks,
            block_size=engine.block_size,
            accepts_images=self.processor.vision is not None,
            dtype=engine.dtype,
            packed_linear_layers=self._packed_linear_layers,
            fused_projections=self._fused_projections,
            decode_attention=engine.decode_attention,
            cuda_graph_max_batch=engine.cuda_graph_max_batch,
            deterministic=engine.deterministic,
        )

    def stats(self, replica: str | None = None) -> WorkerStats:
        """`replica` pins the call to one replica (the router reads it), for per-replica reads."""
        engine, transfers = self.engine.stats(), self.processor.handoffs.stats
        return WorkerStats(
            active_requests=engine.active_requests,
            waiting=engine.waiting,
            running=engine.running,
            kv_blocks_used=engine.kv_blocks_used,
            kv_blocks_total=engine.kv_blocks_total,
            engine_steps=self.engine.steps,
            prefix_cache_query_tokens=engine.prefix_cache_query_tokens,
            prefix_cache_hit_tokens=engine.prefix_cache_hit_tokens,
            pid=os.getpid(),
            rss_bytes=_resident_bytes(),
            open_channels=len(self.channels),
            requests_by_channel=self._requests_by_channel,
            requests_by_call=self._requests_by_call,
            queued_prompt_tokens=engine.queued_prompt_tokens,
            kv_handoffs_sent=transfers.sent,
            kv_handoffs_received=transfers.received,
            kv_handoffs_missed=transfers.missed,
            kv_transfer_tokens=transfers.tokens,
            kv_held_tokens=transfers.held_tokens,
            kv_transfer_bytes=transfers.bytes,
            kv_transfer_ms=transfers.ms,
            spec_drafts=engine.spec_drafts,
            spec_draft_tokens=engine.spec_draft_tokens,
            spec_accepted_tokens=engine.spec_accepted_tokens,
        )

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics, read every metrics interval when autoscaling is
        on; the engine-load policy (workers/serving/engine_load_policy.py) scales on them."""
        engine = self.engine.stats()
        kv_usage = engine.kv_blocks_used / engine.kv_blocks_total if engine.kv_blocks_total else 0.0
        return EngineLoad(engine.waiting, kv_usage, engine.queued_prompt_tokens).as_metrics()

    async def check_health(self) -> None:
        """Serve calls this periodically; raising marks the replica unhealthy and replaces it
        (a split model's replica with all its shards)."""
        if not self.engine.alive:
            raise RuntimeError(f"engine thread is not running: {self.engine.error!r}")
        stuck = self.engine.stuck_for()
        if stuck > self.config.engine.step_hang_timeout_s:
            raise RuntimeError(f"engine step running for {stuck:.0f} s: the engine loop is hung")
        for rank, shard in enumerate(self._shards, start=1):
            try:
                failure = await asyncio.wait_for(shard.alive.remote(), SHARD_CHECK_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - dead, or not answering: either way the replica goes
                failure = f"{type(exc).__name__}: {exc}"
            if failure is not None:
                raise RuntimeError(f"shard {rank} of the split model is not running: {failure}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()


def _embedding_refusal(shards, processor: RequestProcessor) -> str | None:
    """Why a replica serves no embeddings: the pooled hidden states are read on one device
    from a text model's decoder."""
    if shards:
        return "it is split over devices"
    if processor.vision is not None:
        return "it is a vision-language model"
    return None


def decoder_pooler(pooler: PoolerConfig, model_dir) -> PoolerConfig:
    """A generating model's pooler with its pooling_type decided: as configured, else the
    checkpoint's sentence-transformers choice, else LAST. CLS is an encoder's (a decoder's
    first token has seen nothing after it): a ValueError naming the field."""
    pooling = pooler.pooling_type or own_pooling(model_dir) or "LAST"
    if pooling == "CLS":
        raise ValueError("pooler_config.pooling_type: CLS pools an encoder's first token; a generating model pools "
                         "LAST or MEAN (an encoder checkpoint is served with runner: pooling)")
    return pooler.model_copy(update={"pooling_type": pooling})
