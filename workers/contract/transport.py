"""What travels on the worker -> ingress transport besides chunks (serve_app/transport/,
workers/serving/channels.py)."""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.chunks import GenerationChunk

# One message of a channel: every chunk pending for this ingress when the worker sent it,
# as (request id, chunk), oldest first; a backlog of one choice is one chunk.
ChannelBatch = list[tuple[str, GenerationChunk]]


@dataclass(frozen=True)
class ChannelReceipt:
    """The last message of a request's own call when its chunks went by its channel: how
    many channel entries carried them. The ingress waits for that many before it decides
    the stream broke (the two streams need not arrive in order)."""

    entries: int
