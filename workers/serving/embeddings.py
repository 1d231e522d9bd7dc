"""POST /v1/embeddings on the worker: tokenize, check, pool, gather and trim. The pooling
itself is the backend's: a generating model's engine, where each input becomes an engine
request that prefills its prompt beside the generating ones and ends with a pooled vector
instead of a token (workers/engine/pooling.py); or an encoder's padded batches
(workers/serving/encoder_batches.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from typing import Protocol

from workers.contract.chunks import ErrorInfo
from workers.contract.embeddings import EmbedRequest, EmbedResult
from workers.contract.errors import WorkerError
from workers.contract.model_config import PoolerConfig
from workers.contract.sampling_params import Pooling, SamplingParams
from workers.core.events import TokenEvent
from workers.serving.async_engine import AsyncEngine, RequestStream
from workers.serving.request_trace import RequestTiming, WorkerTracing, record_spans

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PooledInput:
    """One input's vector, when it was first scheduled (None: never queued) and when it was done."""

    vector: list[float]
    queue_time: float | None
    time: float


class PoolingBackend(Protocol):
    """What computes the vectors: the inputs of one request, submitted together."""

    @property
    def longest_input(self) -> int: ...

    async def pool(self, prompts: list[list[int]]) -> list[PooledInput]: ...


class EnginePooling:
    """A generating model's engine as the backend: every input one engine request."""

    def __init__(self, engine: AsyncEngine, pooler: PoolerConfig) -> None:
        """`pooler`: its pooling_type resolved (LAST or MEAN)."""
        self.engine = engine
        self.params = SamplingParams(max_tokens=1, pooling=Pooling(pooler.pooling_type.lower(), pooler.normalize))

    @property
    def longest_input(self) -> int:
        return self.engine.limits.max_model_len - 1  # the engine's check counts one output position

    async def pool(self, prompts: list[list[int]]) -> list[PooledInput]:
        """Every prompt submitted at once, so the engine batches them; a caller that leaves
        aborts those still running."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in prompts]
        streams: list[RequestStream] = []
        try:
            for i, (ids, done) in enumerate(zip(prompts, futures)):
                try:
                    stream = self.engine.add_request(ids, self.params)
                except WorkerError as exc:
                    exc.param, exc.prefix = "input", f"input.{i}: "
                    raise
                stream.sink = _settle(stream, done)
                streams.append(stream)
            events: list[TokenEvent] = await asyncio.gather(*futures)
        finally:
            for stream in streams:
                self.engine.abort(stream)
        return [PooledInput(e.embedding, e.queue_time, e.time) for e in events]


class Embeddings:
    def __init__(self, backend: PoolingBackend, tokenizer, pooler: PoolerConfig, hidden_size: int,
                 refusal: str | None = None, tracing: WorkerTracing | None = None) -> None:
        """`refusal`: why this model serves no embeddings (e.g. it is split over devices);
        `tracing`: the replica's tracer (a request with a trace context gets its spans)."""
        self.backend = backend
        self.tracing = tracing
        self.tokenizer = tokenizer
        self.pooler = pooler
        self.hidden_size = hidden_size
        self.refusal = refusal

    async def embed(self, request: EmbedRequest) -> EmbedResult | ErrorInfo:
        """The inputs' vectors, in order; a 400 for an input the engine cannot take."""
        timing = RequestTiming(request.request_id, time.perf_counter(), 0.0, 0)
        try:
            self._check(request)
            prompts = await asyncio.to_thread(self._token_ids, request)
            timing.admitted, timing.prompt_tokens = time.perf_counter(), sum(map(len, prompts))
            pooled = await self.backend.pool(prompts)
            # The spans' prefill: from the first step of any input to its last vector.
            timing.queue_s = min((p.queue_time for p in pooled if p.queue_time is not None), default=None)
            timing.first_token = timing.last_token = max(p.time for p in pooled)
        except WorkerError as exc:
            timing.error = exc.info()
            return timing.error
        except BaseException as exc:
            timing.failure, timing.cancelled = type(exc).__name__, isinstance(exc, asyncio.CancelledError)
            raise
        finally:
            self._trace(request, timing)
        return EmbedResult([self._trimmed(p.vector, request.dimensions) for p in pooled], timing.prompt_tokens)

    def _trace(self, request: EmbedRequest, timing: RequestTiming) -> None:
        """The request's worker spans (admit, queue, prefill), when it is traced."""
        if self.tracing is None or request.trace_context is None:
            return
        timing.end, timing.end_wall_ns = time.perf_counter(), time.time_ns()
        tracing = self.tracing
        try:
            record_spans(tracing.tracer, request.trace_context, tracing.model, tracing.side, timing)
        except Exception:  # noqa: BLE001 - a span is never worth a request
            logger.exception("writing the spans of %s failed", request.request_id)

    def _check(self, request: EmbedRequest) -> None:
        if self.refusal is not None:
            raise WorkerError(f"this model serves no embeddings: {self.refusal}", param="model")
        dims = request.dimensions
        if dims is not None and not self.pooler.is_matryoshka:
            raise WorkerError("dimensions: this model's vectors cannot be shortened (its pooler_config has no "
                              "is_matryoshka)", param="dimensions", code="unsupported_parameter")
        if dims is not None and not 1 <= dims <= self.hidden_size:
            raise WorkerError(f"dimensions: must be between 1 and the model's {self.hidden_size}", param="dimensions")

    def _token_ids(self, request: EmbedRequest) -> list[list[int]]:
        if request.token_ids is not None:
            prompts = [list(ids) for ids in request.token_ids]
            vocab = len(self.tokenizer)
            for i, ids in enumerate(prompts):
                if any(not 0 <= t < vocab for t in ids):
                    raise WorkerError(f"input.{i}: token ids must be within the vocabulary (0..{vocab - 1})",
                                      param="input", code="invalid_token_id")
        else:
            prompts = [list(self.tokenizer(text, add_special_tokens=True)["input_ids"]) for text in request.texts]
        longest = self.backend.longest_input
        for i, ids in enumerate(prompts):
            if not ids:
                raise WorkerError(f"input.{i}: the input is empty", param="input")
            if len(ids) > longest:
                raise WorkerError(f"input.{i}: {len(ids)} tokens; this model embeds at most {longest} tokens "
                                  "an input", param="input", code="context_length_exceeded")
        return prompts

    def _trimmed(self, vector: list[float], dimensions: int | None) -> list[float]:
        """The first `dimensions` values, at unit length again when the model normalizes."""
        if dimensions is None or dimensions >= len(vector):
            return vector
        head = vector[:dimensions]
        if not self.pooler.normalize:
            return head
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        return [x / norm for x in head]


class EngineStepError(WorkerError, RuntimeError):
    """A model step failed with this input in it (contained to its request by the engine)."""

    status = 500
    type = "internal_error"
    code = "engine_error"


def _settle(stream: RequestStream, done: asyncio.Future):
    """The sink of one input's stream: its one event carries the vector."""

    def sink(items: list[TokenEvent | BaseException]) -> None:
        stream.finished = True
        if done.done():
            return
        item = items[-1]
        if isinstance(item, BaseException):
            done.set_exception(item)
        elif item.error is not None:
            done.set_exception(EngineStepError(f"this input failed inside the engine ({item.error})"))
        else:
            done.set_result(item)

    return sink
