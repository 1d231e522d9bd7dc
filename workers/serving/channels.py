"""The worker's side of the ingress channels: one outbox per ingress replica, drained by
that ingress's long-lived `channel` call, one message per wake-up for all its requests.

A request of an ingress with an open channel here puts its chunks in that channel's
outbox; its own call waits for the end and then sends a `ChannelReceipt` (how many
channel entries carried the request) so the ingress can tell a late chunk from a lost
one. When a channel closes (its ingress went away, or the stream broke), the requests
that were using it end at once: their output has nowhere to go.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from workers.contract.transport import ChannelBatch, ChannelReceipt
from workers.serving.outbox import ChunkOutbox


class ChannelOutbox(ChunkOutbox):
    """An ingress's outbox on this replica, counting what was sent of each request."""

    def __init__(self) -> None:
        super().__init__()
        self._sent: dict[str, int] = {}
        self._in_flight: set[str] = set()  # taken by the channel, not yet known to be sent
        self._progress = asyncio.Event()  # something was sent, or the outbox closed

    async def send(self) -> AsyncIterator[ChannelBatch]:
        """The channel's messages; an entry counts as sent once the consumer asked for the
        next message (Serve asks right after it sent the last one)."""
        async for batch in self.batches():
            self._in_flight = {request_id for request_id, _ in batch}
            yield batch
            for request_id, _ in batch:
                self._sent[request_id] = self._sent.get(request_id, 0) + 1
            self._in_flight = set()
            self._progress.set()

    def close(self) -> None:
        super().close()
        self._progress.set()

    async def receipt(self, request_id: str) -> ChannelReceipt:
        """Once none of the request's chunks waits here or is on its way: how many were sent."""
        while not self.closed and (self.holds(request_id) or request_id in self._in_flight):
            self._progress.clear()
            await self._progress.wait()
        return ChannelReceipt(self._sent.pop(request_id, 0))

    def holds(self, request_id: str) -> bool:
        return self._queue.holds(request_id)


class ChannelRegistry:
    """The open channels of this replica, by ingress id."""

    def __init__(self) -> None:
        self._outboxes: dict[str, ChannelOutbox] = {}

    def open(self, ingress_id: str) -> ChannelOutbox:
        """A fresh outbox for this ingress; an older one of the same ingress is closed."""
        self.close(ingress_id)
        outbox = self._outboxes[ingress_id] = ChannelOutbox()
        return outbox

    def get(self, ingress_id: str | None) -> ChannelOutbox | None:
        return self._outboxes.get(ingress_id) if ingress_id else None

    def close(self, ingress_id: str, outbox: ChannelOutbox | None = None) -> None:
        """Close the ingress's outbox (only `outbox`, when given: a newer one stays)."""
        current = self._outboxes.get(ingress_id)
        if current is not None and (outbox is None or current is outbox):
            del self._outboxes[ingress_id]
            current.close()

    def __len__(self) -> int:
        return len(self._outboxes)


async def until_closed(outbox: ChunkOutbox, work: asyncio.Task) -> None:
    """Wait for `work`, or for the outbox to close before it (then `work` is cancelled)."""
    closing = asyncio.create_task(outbox.wait_closed())
    try:
        await asyncio.wait({work, closing}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        closing.cancel()
        if not work.done():
            work.cancel()
