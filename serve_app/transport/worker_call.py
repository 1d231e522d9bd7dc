"""The one place that calls a model worker, for the HTTP routes and the handle API alike.

A call goes through the worker deployment's `WorkerChannels` (channels.py): the
request's own `generate` call, its chunks by this ingress's channel to the replica that
runs it. Its first chunk is awaited before anything is answered, so errors found by the
worker (context window, template) still get their own status code, and an overloaded
worker (BackPressureError) a 503 with Retry-After. After that, a worker failure ends the
request with an error chunk (503 `worker_failed`), and a caller that stops early cancels
the worker's sequence.

Each dialect supplies what the chunks become: a streamer (`events(first, rest)` -> SSE
text) or an accumulator (`add(chunk)`, `result()`). A worker's error (`ErrorInfo`) becomes
an `APIError` only by `APIError.from_info` (serve_app/http/errors.py): here for the first
chunk, in the streamers and accumulators for a later one.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from serve_app.http.errors import APIError
from serve_app.http.metrics import STATUS_CLIENT_GONE, RecordingStream, RequestRecord
from serve_app.transport.channels import WorkerChannels
from workers.contract.chunks import GenerationChunk
from workers.contract.requests import GenerateRequest

logger = logging.getLogger("chatserve.ingress")

Item = TypeVar("Item")


class Streamer(Protocol):
    def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]: ...


class Accumulator(Protocol):
    def add(self, chunk: GenerationChunk) -> None: ...

    def result(self) -> Any: ...  # has dump_json() -> str


class ChunkStream(Protocol):
    """The worker's chunks after the first; `cancel()` frees the worker's sequence."""

    def __aiter__(self) -> ChunkStream: ...

    async def __anext__(self) -> GenerationChunk: ...

    def cancel(self) -> None: ...


@dataclass
class WorkerCall:
    """A call whose first chunk has arrived without an error; `rest` yields the others."""

    first: GenerationChunk
    rest: ChunkStream


def over_grpc(handle: DeploymentHandle) -> DeploymentHandle:
    """Calls to a worker over Serve's inter-deployment gRPC channel instead of Ray actor
    calls: a streamed chunk then costs a gRPC message, not a Ray object per item (the
    gain is in docs/BENCHMARKS.md). Results come back by value, which is all the ingress
    needs."""
    return handle.options(_by_reference=False, request_serialization="pickle", response_serialization="pickle")


async def call_worker(transport: WorkerChannels, gen_request: GenerateRequest,
                      param_names: Mapping[str, str] | None = None,
                      record: RequestRecord | None = None) -> WorkerCall:
    """Start the call and await its first chunk; a worker error in it raises APIError
    (`param_names` renames the worker's field names to the route's). With a `record`
    (HTTP requests), every chunk is also recorded for the request's metrics. A request
    with a LoRA adapter goes by Serve's model multiplexing to a replica that holds it
    (serve_app/transport/channels.py)."""
    stream: ChunkStream = transport.call(gen_request)
    if record is not None:
        stream = RecordingStream(stream, record)
    return WorkerCall(await _first_chunk(stream, param_names), stream)


async def _first_chunk(stream: ChunkStream, param_names: Mapping[str, str] | None) -> GenerationChunk:
    try:
        first = await stream.__anext__()
    except BackPressureError as exc:
        raise APIError(503, f"server overloaded, retry later ({exc})", type="server_error",
                       code="overloaded", headers={"Retry-After": "1"}) from None
    except StopAsyncIteration:
        raise APIError(500, "the worker ended the request without output", type="internal_error") from None
    if first.error is not None:
        stream.cancel()
        raise APIError.from_info(first.error, param_names)
    return first


async def accumulate(acc: Accumulator, call: WorkerCall) -> Any:
    """Fold the whole worker stream into the accumulator's result; cancel the worker call on error or exit."""
    finished = False
    try:
        acc.add(call.first)
        async for chunk in call.rest:
            acc.add(chunk)
        finished = True
    finally:
        if not finished:
            call.rest.cancel()
    return acc.result()


async def relay(items: AsyncIterator[Item], call: WorkerCall, record: RequestRecord | None = None) -> AsyncIterator[Item]:
    """Forward what the chunks became (SSE events, chunk objects); if the caller leaves
    early, cancel the worker call too. Then finish the request's record, if any: 200, 499
    (client gone) or 500 (an exception)."""
    status = STATUS_CLIENT_GONE
    try:
        async for item in items:
            yield item
        status = 200
    except Exception:
        status = 500
        raise
    finally:
        if status != 200:
            call.rest.cancel()
        if record is not None:
            record.finish(status)
