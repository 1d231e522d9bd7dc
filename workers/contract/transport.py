"""What travels on the worker -> ingress transport besides chunks (serve_app/transport/,
workers/serving/channels.py)."""

from __future__ import annotations

import asyncio
import pickle
import struct
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


@dataclass(frozen=True)
class ChannelEndpoint:
    """Where a worker replica's channel socket listens (workers/serving/channel_socket.py),
    and the token a connection's first line must carry (only a caller of the deployment,
    which got it by a Serve call, can open a channel)."""

    host: str
    port: int
    token: str


# A channel socket's messages: a 4-byte big-endian length, then the pickled ChannelBatch
# (both ends are this code; the ingress unpickles only what the replica it asked wrote).
FRAME_HEADER = struct.Struct(">I")


def encode_batch(batch: ChannelBatch) -> bytes:
    payload = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
    return FRAME_HEADER.pack(len(payload)) + payload


async def read_batch(reader: asyncio.StreamReader) -> ChannelBatch | None:
    """The next message, or None when the worker closed the channel between messages
    (asyncio.IncompleteReadError when it closed in the middle of one)."""
    header = await reader.read(FRAME_HEADER.size)
    if not header:
        return None
    if len(header) < FRAME_HEADER.size:
        header += await reader.readexactly(FRAME_HEADER.size - len(header))
    (size,) = FRAME_HEADER.unpack(header)
    return pickle.loads(await reader.readexactly(size))
