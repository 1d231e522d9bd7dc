"""The ingress's transport (serve_app/transport/) against fake worker handles: channels open
for the replicas the router names and close for the ones it drops, a request's chunks
arrive by its replica's channel and its own call ends with a receipt, a slow reader gets
the backlog merged, and a stream that breaks or ends early ends the request with a 503."""

from __future__ import annotations

import asyncio
import uuid
from types import SimpleNamespace

import pytest
from ray.serve.exceptions import RequestCancelledError

from serve_app.transport.channels import WorkerChannels
from serve_app.transport.mailbox import RequestMailbox
from serve_app.transport.router import (
    PIN_KEYWORD,
    ReplicaDirectory,
    WorkerRouter,
    deployment_key,
)
from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ResumeConfig
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams
from workers.contract.transport import ChannelReceipt

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models

NO_RESUME = ResumeConfig(enabled=False)


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
        try:
            message = await self.queue.get()
        except asyncio.CancelledError:
            # As Serve's response generator: a call cancelled, then its reader's task
            # cancelled, raises RequestCancelledError in that reader, not CancelledError.
            if self.cancelled:
                raise RequestCancelledError("r") from None
            raise
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

    def _channel(self, ingress_id: str, socket: bool = False, **kwargs) -> Stream:
        """A channel of a replica without a socket: its messages are the chunks (the first
        one too), whether or not the ingress asked for a socket."""
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


def open_channels(transport: WorkerChannels) -> int:
    """The channels (one reader each) the transport holds open."""
    return len(transport._readers)


async def call_on_replica(replica: str = "a", resume: ResumeConfig = ResumeConfig(enabled=False)):
    """(workers, the request's mailbox, its own call, the replica's channel): a request of
    an ingress whose channel to `replica` is open."""
    workers = FakeWorkers()
    transport = WorkerChannels(workers, resume)
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
        assert set(workers.channels) == {"a", "b"} and open_channels(transport) == 2
        publish(workers, "b", "c")
        await settle()
        assert workers.channels["a"][0].cancelled and set(workers.channels) == {"a", "b", "c"}
        assert open_channels(transport) == 2
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
        transport = WorkerChannels(workers, NO_RESUME)
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
        mailbox = RequestMailbox(request("r", n=2))
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
    pinned = SimpleNamespace(kwargs={PIN_KEYWORD: "b"}, routing_context=SimpleNamespace(should_backoff=False))
    gone = SimpleNamespace(kwargs={PIN_KEYWORD: "z"}, routing_context=SimpleNamespace(should_backoff=False))
    choose = WorkerRouter.choose_replicas
    assert asyncio.run(choose(None, [a, b], pinned)) == [[b]]
    assert asyncio.run(choose(None, [a, b], gone)) == [[]]  # nothing yet: Serve retries...
    # ...sleeping between tries: a retry without a sleep would spin the router's loop.
    assert gone.routing_context.should_backoff


def test_the_router_tells_the_channels_of_a_dead_replica_at_once():
    """Serve drops a dead replica from its router before the controller's next update; the
    channels hear of it then, not seconds later."""
    from ray.serve._private.common import DeploymentID

    def replica(name: str):
        return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name))

    router = WorkerRouter.__new__(WorkerRouter)  # only the state a replica's death touches
    router._deployment_id = DeploymentID(name=f"workers-{uuid.uuid4().hex}", app_name="app")
    router._replicas = {"a": replica("a"), "b": replica("b")}
    router._replica_id_set = {"a", "b"}
    router._queue_len_gauge_last_update = {}
    router._colocated_replica_ids = {}
    router._multiplexed_model_id_to_replica_ids = {}
    heard: list[frozenset[str]] = []
    ReplicaDirectory.subscribe(deployment_key("app", router._deployment_id.name), heard.append)
    router.on_replica_actor_died("a")
    assert heard == [frozenset({"b"})]


# ------------------------------------------------------------------------------ resuming


def ids(*values: int) -> list[int]:
    return list(values)


def piece(text_: str, token_ids: list[int], finish: str | None = None, index: int = 0) -> GenerationChunk:
    return GenerationChunk(index=index, text=text_, token_ids=token_ids, finish_reason=finish)


def test_a_broken_stream_resumes_on_another_replica_from_the_ids_received():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("Hel", ids(1, 2)))])
        first = await anext(mailbox)
        own_call.fail(RuntimeError("ActorDiedError"))  # the replica died
        await settle()
        resumed, second_call = workers.calls[1]
        second_call.push([piece("lo", ids(3), "stop")])  # no channel to the new replica yet: by the call
        second_call.close()
        rest = [c async for c in mailbox]
        return first, rest, resumed

    first, rest, resumed = asyncio.run(body())
    assert first.text + "".join(c.text for c in rest) == "Hello"
    assert all(c.error is None for c in rest) and rest[-1].finish_reason == "stop"
    assert resumed.request_id.startswith("r~") and resumed.resume.choices[0].token_ids == (1, 2)
    assert not resumed.resume.choices[0].finished and resumed.messages == request("r").messages


def test_the_replaced_attempts_cancelled_call_does_not_break_the_new_attempt():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        channel.fail(RuntimeError("ActorDiedError"))  # the channel breaks first; the call is still open
        await settle()
        second_call = workers.calls[1][1]
        assert own_call.cancelled and not second_call.cancelled
        await asyncio.sleep(0.7)  # past the retry delay: a spurious break would have restarted it
        second_call.push([piece("b", ids(2), "length")])
        second_call.close()
        return [c.text async for c in mailbox], len(workers.calls), second_call.cancelled

    texts, calls, cancelled = asyncio.run(body())
    assert texts == ["b"] and calls == 2 and not cancelled


def test_late_chunks_of_the_broken_attempt_are_dropped():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        own_call.fail(RuntimeError("ActorDiedError"))
        await settle()
        channel.push([("r", piece("late", ids(9)))])  # the old attempt's id: nobody listens
        second_call = workers.calls[1][1]
        second_call.push([piece("b", ids(2), "length")])
        second_call.close()
        return [c.text async for c in mailbox]

    assert asyncio.run(body()) == ["b"]


def test_a_worker_bug_is_not_resumed():
    from ray.exceptions import RayTaskError

    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        own_call.fail(RayTaskError("generate", "Traceback", ValueError("bug")))
        return [c async for c in mailbox], len(workers.calls)

    (failed,), calls = asyncio.run(body())
    assert failed.error.code == "worker_failed" and calls == 1


def test_resumes_are_bounded_then_the_request_fails():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig(max_resumes=1))
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        own_call.fail(RuntimeError("ActorDiedError"))
        await settle()
        second_call = workers.calls[1][1]
        second_call.push([piece("b", ids(2))])
        await anext(mailbox)
        second_call.fail(RuntimeError("ActorDiedError"))  # a second loss: over the bound
        return [c async for c in mailbox], len(workers.calls)

    (failed,), calls = asyncio.run(body())
    assert failed.error.code == "worker_failed" and calls == 2


def test_a_replica_leaving_the_router_hands_its_requests_over_at_once():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        publish(workers, "b")  # "a" is scaled down or replaced
        await settle()
        assert own_call.cancelled  # the old replica frees the sequence now
        resumed, second_call = workers.calls[1]
        second_call.push([piece("b", ids(2), "stop")])
        second_call.close()
        return [c.text async for c in mailbox], resumed.resume

    rest, continuation = asyncio.run(body())
    assert rest == ["b"] and continuation.choices[0].token_ids == (1,)


def test_a_dead_replicas_call_and_channel_breaking_together_resume_the_request_once(monkeypatch):
    monkeypatch.setattr("serve_app.transport.channels.REOPEN_DELAY_S", 0.01)

    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        own_call.fail(RuntimeError("ActorDiedError"))
        channel.fail(RuntimeError("ActorDiedError"))
        publish(workers, "b")  # the router dropped the dead replica
        await settle()
        resumed_calls = len(workers.calls) - 1
        second_call = workers.calls[-1][1]
        second_call.push([piece("b", ids(2), "stop")])
        second_call.close()
        rest = [c.text async for c in mailbox]
        await asyncio.sleep(0.05)  # several reopening delays
        return resumed_calls, rest, len(workers.channels["a"])

    resumed_calls, rest, channels_to_the_dead_replica = asyncio.run(body())
    assert resumed_calls == 1 and rest == ["b"]
    assert channels_to_the_dead_replica == 1  # not reopened once the replica left


def test_a_replica_stopping_with_none_to_take_over_finishes_its_requests_on_its_channel():
    async def body():
        workers, mailbox, own_call, channel = await call_on_replica(resume=ResumeConfig())
        channel.push([("r", piece("a", ids(1)))])
        await anext(mailbox)
        publish(workers)  # the app is being deleted: no replica left to resume on
        await settle()
        assert not own_call.cancelled and not channel.cancelled and len(workers.calls) == 1
        channel.push([("r", piece("b", ids(2), "length"))])  # it finishes within its grace period
        rest = [c.text async for c in mailbox]
        await settle()
        return rest, channel.cancelled

    assert asyncio.run(body()) == (["b"], True)  # then its channel closes
