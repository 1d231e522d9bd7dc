"""The worker's side of the ingress channels, in-process (no Ray): a request of an ingress
with an open channel sends its chunks there and its own call only the receipt; a closed
channel ends the requests that were using it; a channel asked for a socket names it, and
the connection carries the chunks; without a channel the call carries the chunks itself,
everything pending per message."""

from __future__ import annotations

import asyncio
import dataclasses

from tests.support.engines import chat_request, wait_idle
from tests.unit.serving.test_deployment import _with_worker
from workers.contract.chunks import GenerationChunk
from workers.contract.transport import ChannelEndpoint, ChannelReceipt, read_batch
from workers.serving.channels import ChannelOutbox, ChannelRegistry


def with_ingress(request, ingress_id: str = "ingress-1"):
    return dataclasses.replace(request, ingress_id=ingress_id)


def test_chunks_go_by_the_channel_and_the_call_ends_with_the_count_sent(tiny_model_dir):
    async def body(worker):
        channel = worker.channel("ingress-1", replica="pinned")
        received: list[tuple[str, GenerationChunk]] = []

        async def read_channel():
            async for batch in channel:
                received.extend(batch)

        reader = asyncio.create_task(read_channel())
        await asyncio.sleep(0)  # the channel opens
        request = with_ingress(chat_request("Hello there", 12, ignore_eos=True))
        own = [message async for message in worker.generate(request)]
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await wait_idle(worker.engine)
        return own, received, len(worker.channels)

    own, received, open_channels = _with_worker(tiny_model_dir, {}, body)
    (receipt,) = own
    assert isinstance(receipt, ChannelReceipt) and receipt.entries == len(received) > 0
    assert {request_id for request_id, _ in received} == {"r"}
    chunks = [chunk for _, chunk in received]
    assert sum(len(c.token_ids) for c in chunks) == 12 and chunks[-1].finish_reason == "length"
    assert open_channels == 0  # the channel closed with its reader


def test_a_socket_channel_carries_the_chunks_and_the_call_names_the_socket(tiny_model_dir):
    async def body(worker):
        channel = worker.channel("ingress-1", replica="pinned", socket=True)
        endpoint = await anext(channel)
        held = asyncio.create_task(anext(channel))  # the call stays open beside the socket
        reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
        writer.write(f"{endpoint.token} ingress-1\n".encode())
        while worker.channels.get("ingress-1") is None:
            await asyncio.sleep(0.01)
        request = with_ingress(chat_request("Hello there", 12, ignore_eos=True))
        own = [message async for message in worker.generate(request)]
        received = []
        while sum(len(chunk.token_ids) for _, chunk in received) < 12:
            received.extend(await read_batch(reader))
        still_open = not held.done()
        writer.close()
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
        while len(worker.channels):  # the connection's end closed the outbox
            await asyncio.sleep(0.01)
        await wait_idle(worker.engine)
        return endpoint, own, received, still_open

    endpoint, (receipt,), received, still_open = _with_worker(tiny_model_dir, {}, body)
    assert isinstance(endpoint, ChannelEndpoint) and endpoint.host == "127.0.0.1" and still_open
    assert isinstance(receipt, ChannelReceipt) and receipt.entries == len(received)
    assert {request_id for request_id, _ in received} == {"r"} and received[-1][1].finish_reason == "length"


def test_without_a_channel_the_call_carries_lists_of_chunks(tiny_model_dir):
    async def body(worker):
        return [message async for message in worker.generate(with_ingress(chat_request("Hi", 6, ignore_eos=True),
                                                                          "no-such-ingress"))]

    messages = _with_worker(tiny_model_dir, {}, body)
    assert all(isinstance(m, list) and m for m in messages)
    chunks = [c for m in messages for c in m]
    assert sum(len(c.token_ids) for c in chunks) == 6 and chunks[-1].finish_reason == "length"


def test_a_channel_that_closes_ends_the_requests_using_it(tiny_model_dir):
    async def body(worker):
        channel = worker.channel("ingress-1")
        reader = asyncio.create_task(anext(channel))
        await asyncio.sleep(0)
        own = worker.generate(with_ingress(chat_request("Hello there", 300, ignore_eos=True)))
        ending = asyncio.create_task(anext(own))
        await reader  # the request is running
        await channel.aclose()  # the ingress went away
        receipt = await asyncio.wait_for(ending, 10)
        await wait_idle(worker.engine)
        return receipt, worker.stats()

    receipt, stats = _with_worker(tiny_model_dir, {"max_model_len": 400}, body)
    # The batch the channel held when it closed was never confirmed sent: not counted.
    assert receipt == ChannelReceipt(0)
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0


def test_a_reopened_channel_replaces_the_old_one():
    registry = ChannelRegistry()
    old = registry.open("i")
    new = registry.open("i")
    assert old.closed and registry.get("i") is new and not new.closed
    registry.close("i", old)  # the old reader's cleanup leaves the new channel alone
    assert registry.get("i") is new
    registry.close("i", new)
    assert registry.get("i") is None and len(registry) == 0


def test_the_receipt_counts_only_entries_the_channel_sent():
    async def body():
        outbox = ChannelOutbox()
        sender = outbox.send()
        outbox.put("r", GenerationChunk(text="a", token_ids=[1]))
        outbox.put("s", GenerationChunk(text="x", token_ids=[2]))
        first = await anext(sender)  # taken, on its way: not counted yet
        receipt = asyncio.create_task(outbox.receipt("r"))
        await asyncio.sleep(0)
        assert not receipt.done()
        outbox.put("r", GenerationChunk(text="b", token_ids=[3], finish_reason="stop"))
        second = await anext(sender)  # asking for it marks the first as sent
        outbox.close()
        with_rest = [second] + [batch async for batch in sender]
        return first, with_rest, await receipt

    first, rest, receipt = asyncio.run(body())
    assert [rid for rid, _ in first] == ["r", "s"] and [rid for rid, _ in rest[0]] == ["r"]
    assert receipt == ChannelReceipt(2)
