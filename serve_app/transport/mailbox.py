"""One request's chunks at the ingress, from wherever they come: its own worker call, or
the channel of the worker replica that runs it; read as a stream of chunks.

Chunks that arrive while the reader is busy (writing to the client) merge per choice
(workers/contract/coalescing.py), so a slow client costs one event per write, not one
per token. The request is complete when every choice has finished or an error came; a
stream that ends before that is a broken one and ends with a 503 `worker_failed` chunk.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

from ray.serve.exceptions import BackPressureError

from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.coalescing import CoalescingQueue
from workers.contract.transport import ChannelReceipt

logger = logging.getLogger("chatserve.ingress")


def worker_failed(reason: str) -> GenerationChunk:
    return GenerationChunk(error=ErrorInfo(503, f"the model worker failed ({reason}); retry the request",
                                           type="server_error", code="worker_failed"))


class RequestMailbox:
    def __init__(self, request_id: str, num_choices: int, release: Callable[[], None] = lambda: None) -> None:
        """`release` runs once when the request is done with (read to the end, or cancelled)."""
        self.request_id = request_id
        self.replica: str | None = None  # the worker replica whose channel delivered to it, once known
        self._queue = CoalescingQueue()
        self._ready = asyncio.Event()
        self._taken: collections.deque[GenerationChunk] = collections.deque()
        self._unfinished = set(range(num_choices))
        self._failed = False  # an error chunk arrived: nothing follows it
        self._overloaded: BackPressureError | None = None
        self._control: asyncio.Task | None = None
        self._call = None
        self._control_done = False
        self._expected: int | None = None  # channel entries the worker says it sent
        self._received = 0  # channel entries that arrived
        self._arrived = False  # any chunk, by either way
        self._release = release

    def start(self, call) -> None:
        """Read the worker call (its own chunks, or the receipt of what its replica's channel sent)."""
        self._call = call
        self._control = asyncio.create_task(self._read_control(call))

    def put(self, chunk: GenerationChunk, from_channel: bool = False, replica: str | None = None) -> None:
        if from_channel:
            self._received += 1
            self.replica = self.replica or replica
        self._arrived = True
        if chunk.error is not None:
            self._failed = True
        elif chunk.finish_reason is not None:
            self._unfinished.discard(chunk.index)
        self._queue.put(self.request_id, chunk)
        self._ready.set()
        if self.complete:
            self._release_once()  # nothing more can come for it

    def channel_broke(self, reason: str) -> None:
        """The channel this request's chunks came by ended: what it did not deliver never will."""
        if not self.complete:
            self.put(worker_failed(reason))

    @property
    def complete(self) -> bool:
        return self._failed or not self._unfinished

    def __aiter__(self) -> RequestMailbox:
        return self

    async def __anext__(self) -> GenerationChunk:
        while not self._taken:
            self._taken.extend(chunk for _, chunk in self._queue.take_all())
            if self._taken:
                break
            if self._overloaded is not None:
                raise self._overloaded
            if self.complete:
                raise StopAsyncIteration
            if self._control_done and self._received >= (self._expected or 0):
                if not self._arrived:
                    raise StopAsyncIteration  # nothing at all: the caller says so (an empty call is a bug)
                self.put(worker_failed("its stream ended before the request did"))
                continue
            self._ready.clear()
            await self._ready.wait()
        return self._taken.popleft()

    def cancel(self) -> None:
        """Stop the request (the client left, or the reader stopped early); frees the worker's sequence."""
        if self._call is not None:
            self._call.cancel()
        if self._control is not None:
            self._control.cancel()
        self._release_once()

    async def _read_control(self, call) -> None:
        try:
            async for message in call:
                if isinstance(message, ChannelReceipt):
                    self._expected = message.entries
                else:
                    for chunk in message:
                        self.put(chunk)
        except BackPressureError as exc:
            self._overloaded = exc
            self._release_once()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any worker-side failure ends this request only
            logger.warning("model worker call failed: %s", type(exc).__name__)
            self.put(worker_failed(type(exc).__name__))
        finally:
            self._control_done = True
            self._ready.set()

    def _release_once(self) -> None:
        release, self._release = self._release, lambda: None
        release()
