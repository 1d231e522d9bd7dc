"""The ingress's transport (serve_app/transport/) against fake worker handles: channels open
for the replicas the router names and close for the ones it drops, a request's chunks
arrive by its replica's channel and its own call ends with a receipt, a slow reader gets
the backlog merged, and a stream that breaks or ends early ends the request with a 503."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest

from serve_app.transport.channels import WorkerChannels
from serve_app.transport.mailbox import RequestMailbox
from serve_app.transport.router import (
    PIN_KEYWORD,
    ReplicaDirectory,
    WorkerRouter,
    deployment_key,
)
from workers.contract.chunks import GenerationChunk
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.transport import ChannelReceipt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models


def text(piece: str, finish: str | None = None, index: int = 0) -> GenerationChunk:
    return GenerationChunk(index=index, text=piece, token_ids=[1], finish_reason=finish)


class Stream:
    """A streaming call whose messages a test pushes; `close()` ends it, `fail()` breaks it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = False

    def push(self, message) -> None:
        self.queue.put_nowait(message)

    def close(self) -> None:
        self.queue.put_nowait(StopAsyncIteration())

    def fail(self, exc: BaseException) -> None:
        self.queue.put_nowait(exc)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self):
        message = await self.queue.get()
        if isinstance(message, BaseException):
            raise message
        return message

    def cancel(self) -> None:
        self.cancelled = True


class FakeWorkers:
    """A worker deployment's handle: `generate` and `channel` calls become Streams the test drives."""

    app_name = "app"

    def __init__(self) -> None:
        self.deployment_name = f"workers-{uuid.uuid4().hex}"  # each test its own directory entry
        self.calls: list[tuple[GenerateRequest, Stream]] = []
        self.channels: dict[str, list[Stream]] = {}
        self.generate = SimpleNamespace(remote=self._generate)
        self.channel = SimpleNamespace(remote=self._channel)

    def options(self, stream: bool) -> FakeWorkers:
        return self

    def _generate(self, request: GenerateRequest) -> Stream:
        stream = Stream()
        self.calls.append((request, stream))
        return stream

    def _channel(self, ingress_id: str, **kwargs) -> Stream:
        stream = Stream()
        self.channels.setdefault(kwargs[PIN_KEYWORD], []).append(stream)
        return stream


def request(request_id: str = "r", n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, params=SamplingParams(n=n, temperature=1.0), prompt="Hi")


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def publish(workers: FakeWorkers, *replicas: str) -> None:
    ReplicaDirectory.publish(deployment_key(workers.app_name, workers.deployment_name), frozenset(replicas))


async def call_on_replica(replica: str = "a"):
    """(workers, the request's mailbox, its own call, the replica's channel): a request of
    an ingress whose channel to `replica` is open."""
    workers = FakeWorkers()
    transport = WorkerChannels(workers)
    publish(workers, replica)
    mailbox = transport.call(request("r"))
    await settle()
    return workers, mailbox, workers.calls[0][1], workers.channels[replica][0]


def test_channels_follow_the_replicas_the_router_names():
    async def body():
        workers = FakeWorkers()
        transport = WorkerChannels(workers)
        transport.start()
        publish(workers, "a", "b")
        await settle()
        assert set(workers.channels) == {"a", "b"} and transport.open_channels == 2
        publish(workers, "b", "c")
        await settle()
        assert workers.channels["a"][0].cancelled and set(workers.channels) == {"a", "b", "c"}
        assert transport.open_channels == 2
        transport.stop()
        await settle()
        assert all(streams[-1].cancelled for streams in workers.channels.values())

    asyncio.run(body())


def test_a_requests_chunks_come_by_its_replicas_channel_and_its_call_ends_with_a_receipt():
    async def body():
        workers = FakeWorkers()
        transport = WorkerChannels(workers)
        transport.start()
        publish(workers, "a")
        await settle()
        mailbox = transport.call(request("r"))
        (sent, own_call), channel = workers.calls[0], workers.channels["a"][0]
        assert sent.ingress_id == transport.ingress_id
        channel.push([("r", text("Hel")), ("other", text("ignored"))])
        first = await anext(mailbox)
        channel.push([("r", text("lo", "stop"))])
        own_call.push(ChannelReceipt(entries=2))
        own_call.close()
        rest = [c async for c in mailbox]
        return first.text, [c.text for c in rest], mailbox.replica

    assert asyncio.run(body()) == ("Hel", ["lo"], "a")


def test_the_receipt_may_come_before_the_last_channel_entry():
    async def body():
        _, mailbox, own_call, channel = await call_on_replica()
        own_call.push(ChannelReceipt(entries=1))  # the two streams need not arrive in order
        own_call.close()
        await settle()
        channel.push([("r", text("done", "length"))])
        return [c.text async for c in mailbox]

    assert asyncio.run(body()) == ["done"]


def test_a_slow_reader_gets_the_backlog_as_one_chunk():
    async def body():
        workers = FakeWorkers()
        transport = WorkerChannels(workers)
        mailbox = transport.call(request("r"))
        own_call = workers.calls[0][1]
        for piece in ("a", "b", "c"):
            own_call.push([text(piece)])
        own_call.push([text("d", "stop")])
        own_call.close()
        await settle()
        return [(c.text, c.token_ids, c.finish_reason) async for c in mailbox]

    assert asyncio.run(body()) == [("abcd", [1, 1, 1, 1], "stop")]


@pytest.mark.parametrize("how", ["ends", "breaks"])
def test_a_stream_that_stops_before_the_request_is_done_ends_it_with_a_503(how):
    async def body():
        workers = FakeWorkers()
        transport = WorkerChannels(workers)
        mailbox = transport.call(request("r"))
        own_call = workers.calls[0][1]
        own_call.push([text("partial")])
        if how == "ends":
            own_call.close()
        else:
            own_call.fail(RuntimeError("replica died"))
        return [c async for c in mailbox]

    partial, failed = asyncio.run(body())
    assert partial.text == "partial"
    assert (failed.error.status, failed.error.code) == (503, "worker_failed")


def test_a_broken_channel_fails_the_requests_it_was_carrying():
    async def body():
        _, mailbox, _, channel = await call_on_replica()
        channel.push([("r", text("partial"))])
        await settle()
        channel.fail(RuntimeError("gone"))
        return [c async for c in mailbox]

    partial, failed = asyncio.run(body())
    assert partial.text == "partial" and failed.error.code == "worker_failed"


def test_n_choices_complete_when_each_has_finished():
    async def body():
        mailbox = RequestMailbox("r", 2)
        mailbox.put(text("a", "stop", index=0))
        assert not mailbox.complete
        mailbox.put(text("b", "length", index=1))
        return mailbox.complete, [c.index async for c in mailbox]

    assert asyncio.run(body()) == (True, [0, 1])


def test_cancel_cancels_the_call_and_forgets_the_request():
    async def body():
        workers = FakeWorkers()
        transport = WorkerChannels(workers)
        mailbox = transport.call(request("r"))
        mailbox.cancel()
        await settle()
        return workers.calls[0][1].cancelled, transport._mailboxes

    assert asyncio.run(body()) == (True, {})


def test_the_router_sends_a_pinned_call_to_that_replica_only():
    def replica(name: str):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))

    a, b = replica("a"), replica("b")
    pinned = SimpleNamespace(kwargs={PIN_KEYWORD: "b"})
    gone = SimpleNamespace(kwargs={PIN_KEYWORD: "z"})
    choose = WorkerRouter.choose_replicas
    assert asyncio.run(choose(None, [a, b], pinned)) == [[b]]
    assert asyncio.run(choose(None, [a, b], gone)) == [[]]  # nothing yet: Serve retries
