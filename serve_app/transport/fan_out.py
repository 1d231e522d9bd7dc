"""One client request served by several worker calls (a `/v1/completions` list of prompts):
their chunks merged into one stream, as one call with more choices would give them.

Call i's choice j becomes choice `i * choices_per_call + j`; every merged chunk carries the
usage of all calls so far (prompt tokens of every call, each call's running count of
generated tokens, cached tokens where known). Every call's first chunk is awaited before
anything is answered, so an error in any (a prompt too long, an overloaded worker) is the
request's status and the other calls are cancelled. Later chunks go out in the order they
arrive, whichever call they come from; cancelling the merged stream cancels every call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence

from serve_app.http.metrics import RecordingStream, RequestRecord
from serve_app.transport.channels import WorkerChannels
from serve_app.transport.worker_call import ChunkStream, WorkerCall, call_worker
from workers.contract.chunks import GenerationChunk
from workers.contract.requests import GenerateRequest

_DONE = object()  # a call's stream ended


class MergedStream:
    """The merged chunks: the calls' first chunks (already received) in call order, then the
    rest as they come."""

    def __init__(self, calls: Sequence[WorkerCall], choices_per_call: int) -> None:
        self._calls = list(calls)
        self._per_call = choices_per_call
        self._prompt_tokens = [call.first.prompt_tokens for call in calls]
        self._completion_tokens = [0] * len(calls)
        self._cached: list[int | None] = [None] * len(calls)
        self._pending: list[tuple[int, GenerationChunk]] = [(i, call.first) for i, call in enumerate(calls)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pumps: list[asyncio.Task] = []
        self._open = len(calls)

    def __aiter__(self) -> MergedStream:
        return self

    async def __anext__(self) -> GenerationChunk:
        if self._pending:
            return self._merged(*self._pending.pop(0))
        if not self._pumps:
            self._pumps = [asyncio.ensure_future(self._pump(i, call.rest)) for i, call in enumerate(self._calls)]
        while self._open:
            index, item = await self._queue.get()
            if item is _DONE:
                self._open -= 1
                continue
            if isinstance(item, BaseException):
                self.cancel()
                raise item
            return self._merged(index, item)
        raise StopAsyncIteration

    def cancel(self) -> None:
        for pump in self._pumps:
            pump.cancel()
        for call in self._calls:
            call.rest.cancel()

    async def _pump(self, index: int, stream: ChunkStream) -> None:
        try:
            async for chunk in stream:
                await self._queue.put((index, chunk))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await self._queue.put((index, exc))
            return
        await self._queue.put((index, _DONE))

    def _merged(self, index: int, chunk: GenerationChunk) -> GenerationChunk:
        self._completion_tokens[index] = chunk.completion_tokens
        if chunk.cached_tokens is not None:
            self._cached[index] = chunk.cached_tokens
        known = [c for c in self._cached if c is not None]
        return dataclasses.replace(chunk, index=index * self._per_call + chunk.index,
                                   prompt_tokens=sum(self._prompt_tokens),
                                   completion_tokens=sum(self._completion_tokens),
                                   cached_tokens=sum(known) if known else None)


async def fan_out(starts: Sequence[Callable[[], Awaitable[WorkerCall]]], choices_per_call: int) -> MergedStream:
    """Start every call (each `start` awaits its first chunk) and merge them; if one fails,
    the others are cancelled and its error is raised."""
    results = await asyncio.gather(*(start() for start in starts), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        for result in results:
            if isinstance(result, WorkerCall):
                result.rest.cancel()
        raise failed
    return MergedStream(results, choices_per_call)


async def call_workers(transport: WorkerChannels, gen_requests: Sequence[GenerateRequest],
                       param_names: Mapping[str, str] | None, record: RequestRecord) -> WorkerCall:
    """`call_worker` for a request split into `gen_requests` (the same n each): one call
    to the client, its merged chunks recorded as one request's."""
    merged = await fan_out([functools.partial(call_worker, transport, r, param_names) for r in gen_requests],
                           gen_requests[0].params.n)
    stream = RecordingStream(merged, record)
    return WorkerCall(await stream.__anext__(), stream)
