"""Channels on the worker replica's TCP socket (workers/serving/channel_socket.py), in one
process with a real socket on loopback and fake Serve calls: a request's chunks come by the
socket and its own call ends with the receipt; the ingress closing the socket closes the
replica's outbox; the replica closing it breaks the requests on it; a connection without
the replica's token is refused; the Serve call held open beside the socket ending breaks
them too; an unreachable socket falls back to a Serve channel carrying the chunks."""

from __future__ import annotations

import asyncio
import socket

import pytest

from serve_app.transport.channels import WorkerChannels
from tests.unit.api.test_transport import NO_RESUME, FakeWorkers, publish, request, text
from workers.contract.transport import ChannelEndpoint, ChannelReceipt
from workers.serving.channel_socket import ChannelSocket
from workers.serving.channels import ChannelRegistry

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models


class SocketWorkers(FakeWorkers):
    """A worker deployment whose replicas name `endpoint()` as their channel socket: a
    channel call asking for a socket gets it as its first message, then stays open."""

    def __init__(self, endpoint) -> None:
        super().__init__()
        self.endpoint = endpoint
        self.asked_socket: list[bool] = []

    def _channel(self, ingress_id: str, socket: bool = False, **kwargs):
        stream = super()._channel(ingress_id, **kwargs)
        self.asked_socket.append(socket)
        if socket:
            asyncio.get_running_loop().create_task(self._announce(stream))
        return stream

    async def _announce(self, stream) -> None:
        stream.push(await self.endpoint())


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def socket_channel(resume=NO_RESUME):
    """(registry, the replica's socket, workers, transport), the transport's channel to
    replica "a" open on the socket."""
    registry = ChannelRegistry()
    channel_socket = ChannelSocket(registry, "127.0.0.1")
    workers = SocketWorkers(channel_socket.endpoint)
    transport = WorkerChannels(workers, resume)
    transport.start()
    publish(workers, "a")
    await until(lambda: registry.get(transport.ingress_id) is not None)
    return registry, channel_socket, workers, transport


def test_a_requests_chunks_come_by_the_replicas_socket_and_its_call_ends_with_a_receipt():
    async def body():
        registry, channel_socket, workers, transport = await socket_channel()
        mailbox = transport.call(request("r"))
        outbox = registry.get(transport.ingress_id)
        outbox.put("r", text("Hel"))
        outbox.put("other", text("ignored"))
        first = await anext(mailbox)
        outbox.put("r", text("lo", "stop"))
        own_call = workers.calls[0][1]
        own_call.push(ChannelReceipt(entries=2))
        own_call.close()
        rest = [c.text async for c in mailbox]
        transport.stop()
        channel_socket.close()
        return first.text, rest, mailbox.replica, workers.asked_socket

    assert asyncio.run(body()) == ("Hel", ["lo"], "a", [True])  # one call, held open beside the socket


def test_the_ingress_closing_the_socket_closes_the_replicas_outbox():
    async def body():
        registry, channel_socket, _, transport = await socket_channel()
        outbox = registry.get(transport.ingress_id)
        transport.stop()
        await until(lambda: outbox.closed and len(registry) == 0)
        channel_socket.close()

    asyncio.run(body())


async def broken_after_a_chunk(end) -> tuple:
    """A request on the socket channel gets a chunk, then `end(registry, workers, ingress id)`
    breaks the channel: (its first chunk, the rest of its stream)."""
    registry, channel_socket, workers, transport = await socket_channel()
    mailbox = transport.call(request("r"))
    outbox = registry.get(transport.ingress_id)
    outbox.put("r", text("partial"))
    first = await anext(mailbox)
    end(registry, workers, transport.ingress_id)
    rest = [c async for c in mailbox]
    await until(lambda: outbox.closed)  # both ends let go of the channel
    transport.stop()
    channel_socket.close()
    return first, rest


def test_the_replica_closing_the_socket_breaks_the_requests_on_it():
    def replica_ends(registry, workers, ingress_id):  # as a replica whose process ends
        registry.close(ingress_id)

    first, (failed,) = asyncio.run(broken_after_a_chunk(replica_ends))
    assert first.text == "partial" and (failed.error.status, failed.error.code) == (503, "worker_failed")


def test_the_held_call_ending_breaks_the_requests_on_the_socket():
    def call_breaks(registry, workers, ingress_id):  # the replica died, no FIN on the socket
        workers.channels["a"][0].fail(RuntimeError("replica died"))

    first, (failed,) = asyncio.run(broken_after_a_chunk(call_breaks))
    assert first.text == "partial" and (failed.error.status, failed.error.code) == (503, "worker_failed")


def test_a_connection_without_the_replicas_token_is_refused():
    async def body():
        registry = ChannelRegistry()
        channel_socket = ChannelSocket(registry, "127.0.0.1")
        endpoint = await channel_socket.endpoint()
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(b"not-the-token ingress-x\n")
        closed = await asyncio.wait_for(reader.read(), 5.0)
        writer.close()
        channel_socket.close()
        return closed, registry.get("ingress-x")

    assert asyncio.run(body()) == (b"", None)


def test_an_unreachable_socket_falls_back_to_the_serve_channel():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def body():
        async def nowhere() -> ChannelEndpoint:
            return ChannelEndpoint("127.0.0.1", port, "token")

        workers = SocketWorkers(nowhere)
        transport = WorkerChannels(workers, NO_RESUME)
        transport.start()
        publish(workers, "a")
        await until(lambda: len(workers.channels.get("a", [])) == 2)
        mailbox = transport.call(request("r"))
        workers.channels["a"][1].push([("r", text("by Serve", "stop"))])
        own_call = workers.calls[0][1]
        own_call.push(ChannelReceipt(entries=1))
        own_call.close()
        texts = [c.text async for c in mailbox]
        transport.stop()
        return texts, workers.asked_socket, workers.channels["a"][0].cancelled

    # the socket's call cancelled, then a channel whose messages are the chunks
    assert asyncio.run(body()) == (["by Serve"], [True, False], True)
