"""Where a worker puts chunks for one consumer (a request's own stream, or an ingress's
channel), and how that consumer waits for them: one take per wake-up, backlog merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from workers.contract.chunks import GenerationChunk
from workers.contract.coalescing import CoalescingQueue


class ChunkOutbox:
    """Chunks of one or many requests for one consumer on this event loop.

    `put` never blocks and never waits for a timer; the consumer takes everything pending
    each time it wakes, so while it is busy sending, new chunks of a choice merge into the
    one already waiting (workers/contract/coalescing.py)."""

    def __init__(self) -> None:
        self._queue = CoalescingQueue()
        self._ready = asyncio.Event()
        self.closed = False

    def put(self, request_id: str, chunk: GenerationChunk) -> None:
        self._queue.put(request_id, chunk)
        self._ready.set()

    def forget(self, request_id: str, num_choices: int) -> None:
        self._queue.forget(request_id, num_choices)

    def drop(self, request_id: str) -> None:
        self._queue.drop(request_id)

    def close(self) -> None:
        """No more puts: the consumer takes what is left, then its iteration ends."""
        self.closed = True
        self._ready.set()

    async def take(self) -> list[tuple[str, GenerationChunk]]:
        """Everything pending once there is something (or the outbox closed: maybe [])."""
        while not len(self._queue) and not self.closed:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.take_all()

    async def batches(self) -> AsyncIterator[list[tuple[str, GenerationChunk]]]:
        """Non-empty takes until the outbox is closed and drained."""
        while True:
            batch = await self.take()
            if batch:
                yield batch
            elif self.closed:
                return
