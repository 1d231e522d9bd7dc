"""The worker replica's TCP socket for ingress channels: the same channel as
`ModelWorker.channel` (one outbox per ingress replica, one message per wake-up holding
all that was pending), written to a connection the ingress opens instead of sent as the
messages of a Serve streaming call.

Why: each message of a Serve streaming call passes through the replica's Serve wrapper,
Ray's core worker and gRPC here, and through the handle's router thread, a cross-thread
future and Serve's deserializer on the ingress. On a small machine that CPU is taken from
the model's threads, which lose more than it (a preempted thread holds its partner at the
next barrier). On the socket a message is one pickled frame, written and read by the two
event loops.

The ingress asks for the address by a Serve call pinned to this replica
(`ModelWorker.channel(ingress_id, socket=True)`, whose one message is the address and
which stays open beside the connection); a connection's first line must carry this
replica's token (only a caller of the deployment has it) and the ingress id. The ingress closing
the connection closes its outbox, as cancelling the Serve channel does. Where the
ingress cannot connect (a network that allows only Ray's ports), it uses the Serve
channel instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets

from workers.contract.transport import ChannelEndpoint, encode_batch
from workers.serving.channels import ChannelOutbox, ChannelRegistry

logger = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 10.0  # a connection that does not say who it is within this is closed
HELLO_MAX_BYTES = 256


class ChannelSocket:
    def __init__(self, registry: ChannelRegistry, host: str) -> None:
        """`host`: the address to listen on (the node's, so that an ingress on another node
        can connect); the port is the system's choice."""
        self._registry = registry
        self._host = host
        self._token = secrets.token_hex(16)
        self._server: asyncio.Server | None = None
        self._starting = asyncio.Lock()

    async def endpoint(self) -> ChannelEndpoint:
        """Where to connect (listening from the first call on)."""
        async with self._starting:
            if self._server is None:
                self._server = await asyncio.start_server(self._serve, self._host, 0, limit=HELLO_MAX_BYTES)
        port = self._server.sockets[0].getsockname()[1]
        return ChannelEndpoint(self._host, port, self._token)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            ingress_id = await self._hello(reader)
            if ingress_id is None:
                return
            outbox = self._registry.open(ingress_id)
            closing = asyncio.create_task(self._close_at_eof(reader, ingress_id, outbox))
            try:
                await self._send(outbox, writer)
            finally:
                closing.cancel()
                self._registry.close(ingress_id, outbox)
        finally:
            writer.close()

    async def _hello(self, reader: asyncio.StreamReader) -> str | None:
        """The ingress id of a connection that carries this replica's token, else None."""
        try:
            line = await asyncio.wait_for(reader.readline(), HELLO_TIMEOUT_S)
        except (TimeoutError, OSError, ValueError):  # slow, reset, or a line past the limit
            return None
        token, _, ingress_id = line.decode(errors="replace").strip().partition(" ")
        if not ingress_id or not hmac.compare_digest(token.encode(), self._token.encode()):
            logger.warning("refused a channel connection without this replica's token")
            return None
        return ingress_id

    @staticmethod
    async def _send(outbox: ChannelOutbox, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):  # the ingress went away: its requests end
            async for batch in outbox.send():
                writer.write(encode_batch(batch))
                await writer.drain()

    async def _close_at_eof(self, reader: asyncio.StreamReader, ingress_id: str, outbox: ChannelOutbox) -> None:
        """The ingress sends nothing after its first line: a read that returns means it closed."""
        with contextlib.suppress(ConnectionError, OSError):
            await reader.read()
        self._registry.close(ingress_id, outbox)
