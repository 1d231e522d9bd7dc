"""The one worker call (serve_app/transport/worker_call.py) against a fake deployment handle, through
the transport (no channel open: the chunks come by the request's own call): the first
chunk's errors keep their status, worker failures end the request with a 503 chunk, and a
caller that stops early cancels the worker's sequence. Also the handle API's validation."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from ray.serve.exceptions import BackPressureError

from serve_app.dialects.chat.output import CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.handle_api import _validated
from serve_app.http.errors import APIError
from serve_app.http.metrics import STATUS_CLIENT_GONE, IngressMetrics
from serve_app.transport.channels import WorkerChannels
from serve_app.transport.worker_call import accumulate, call_worker, relay
from workers.contract.chunks import ErrorInfo, GenerationChunk
from workers.contract.lora import LoraRequest
from workers.contract.model_config import ResumeConfig
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's pydantic models

NO_RESUME = ResumeConfig(enabled=False)  # resuming has its own tests (test_transport.py)

REQUEST = GenerateRequest(request_id="r", params=SamplingParams(), prompt="Once")
USER = [{"role": "user", "content": "Hi"}]


class FakeCall:
    """A worker's streaming response: a message per item, each a list of one chunk (an
    exception is raised there; a list is sent as it is)."""

    def __init__(self, items: list) -> None:
        self.items = list(items)
        self.cancelled = False
        self.sent = 0

    def __aiter__(self) -> FakeCall:
        return self

    async def __anext__(self) -> list[GenerationChunk]:
        if not self.items:
            raise StopAsyncIteration
        if self.sent:
            await asyncio.sleep(0.01)  # a message a step: a reader that keeps up takes each alone
        self.sent += 1
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item if isinstance(item, list) else [item]

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """Just what the transport uses of a DeploymentHandle: its names, options(stream=True).generate.remote."""

    app_name = "app"
    deployment_name = "worker"

    def __init__(self, items: list) -> None:
        self.call = FakeCall(items)
        self.sent: list[GenerateRequest] = []
        self.multiplexed: list[str] = []
        self.generate = self

    def options(self, stream: bool = True, multiplexed_model_id: str | None = None) -> FakeHandle:
        assert stream
        if multiplexed_model_id is not None:
            self.multiplexed.append(multiplexed_model_id)
        return self

    def remote(self, request: GenerateRequest) -> FakeCall:
        self.sent.append(request)
        return self.call


def text(piece: str, finish: str | None = None) -> GenerationChunk:
    return GenerationChunk(text=piece, finish_reason=finish, prompt_tokens=2, completion_tokens=1)


def called(items: list, then=None, **kwargs):
    """(handle, what `then(call)` returned) for a worker call answering `items`; all on one loop."""
    handle = FakeHandle(items)

    async def body():
        call = await call_worker(WorkerChannels(handle, NO_RESUME), REQUEST, **kwargs)
        return await then(call) if then is not None else call

    return handle, asyncio.run(body())


async def rest_of(call) -> list[GenerationChunk]:
    return [c async for c in call.rest]


def test_the_first_chunk_is_awaited_and_the_rest_follow():
    async def first_and_rest(call):
        return call.first.text, [c.text async for c in call.rest]

    handle, (first, rest) = called([text("a"), text("b", "length")], first_and_rest)
    (sent,) = handle.sent
    assert dataclasses.replace(sent, ingress_id=None) == REQUEST and sent.ingress_id  # it names its ingress
    assert (first, rest) == ("a", ["b"])


def test_an_adapter_request_is_routed_by_its_key():
    lora = LoraRequest.of("sql", "/adapters/sql")
    handle = FakeHandle([text("a", "stop")])
    asyncio.run(call_worker(WorkerChannels(handle, NO_RESUME), dataclasses.replace(REQUEST, lora=lora)))
    assert handle.multiplexed == [lora.key]
    plain, _ = called([text("a", "stop")])
    assert plain.multiplexed == []


def test_a_worker_error_in_the_first_chunk_keeps_its_status_and_renames_its_param():
    error = ErrorInfo(400, "too long", param="messages", code="context_length_exceeded")
    handle = FakeHandle([GenerationChunk(error=error)])
    with pytest.raises(APIError) as info:
        asyncio.run(call_worker(WorkerChannels(handle, NO_RESUME), REQUEST, {"messages": "prompt"}))
    assert (info.value.status, info.value.param, info.value.code) == (400, "prompt", "context_length_exceeded")
    assert handle.call.cancelled


def test_back_pressure_is_503_with_retry_after():
    with pytest.raises(APIError) as info:
        called([BackPressureError(num_queued_requests=9, max_queued_requests=8)])
    assert (info.value.status, info.value.code, info.value.headers) == (503, "overloaded", {"Retry-After": "1"})


def test_a_call_without_output_is_500():
    with pytest.raises(APIError) as info:
        called([])
    assert info.value.status == 500


def test_a_worker_that_fails_midway_ends_with_a_503_chunk():
    _, (failed,) = called([text("a"), RuntimeError("replica died"), text("never")], rest_of)
    assert (failed.error.status, failed.error.code) == (503, "worker_failed")
    assert "RuntimeError" in failed.error.message


def test_a_worker_that_fails_first_is_a_503_error():
    with pytest.raises(APIError) as info:
        called([RuntimeError("replica died")])
    assert (info.value.status, info.value.code) == (503, "worker_failed")


def test_accumulate_cancels_the_call_when_a_chunk_is_an_error():
    items = [text("a"), GenerationChunk(error=ErrorInfo(500, "boom", type="internal_error"))]
    handle = FakeHandle(items)

    async def body():
        call = await call_worker(WorkerChannels(handle, NO_RESUME), REQUEST)
        await accumulate(CompletionAccumulator("r", "m"), call)

    with pytest.raises(APIError):
        asyncio.run(body())
    assert handle.call.cancelled


def test_accumulate_returns_the_result_and_leaves_a_finished_call_alone():
    handle, result = called([text("a"), text("b", "length")],
                            lambda call: accumulate(CompletionAccumulator("r", "m"), call))
    assert result.choices[0].message.content == "ab"
    assert not handle.call.cancelled


def relayed(items: list, take: int, record=None) -> tuple[list, FakeHandle]:
    """Relay the chunks' texts; the caller stops after `take` items."""

    async def consume(call):
        async def texts():
            yield call.first.text
            async for chunk in call.rest:
                yield chunk.text

        got = []
        stream = relay(texts(), call, record)
        async for item in stream:
            got.append(item)
            if len(got) == take:
                break
        await stream.aclose()
        return got

    handle, got = called(items, consume, record=record)
    return got, handle


def test_relay_cancels_the_call_when_the_caller_leaves_early_and_records_499():
    record = IngressMetrics(["m"]).begin("/v1/completions")
    got, handle = relayed([text("a"), text("b"), text("c", "length")], take=2, record=record)
    assert got == ["a", "b"]
    assert handle.call.cancelled
    assert (record.finished, record.status) == (True, STATUS_CLIENT_GONE)
    assert record.completion_tokens == 1  # the chunks passed through the record


def test_relay_to_the_end_records_200_and_cancels_nothing():
    record = IngressMetrics(["m"]).begin("/v1/completions")
    got, handle = relayed([text("a"), text("b", "length")], take=99, record=record)
    assert got == ["a", "b"]
    assert not handle.call.cancelled
    assert (record.finished, record.status) == (True, 200)


def test_handle_api_validates_a_request_model_again():
    valid = ChatCompletionRequest.model_validate({"model": "m", "messages": USER})
    unchecked = ChatCompletionRequest.model_construct(**{**valid.__dict__, "n": 2, "temperature": 0.0})
    with pytest.raises(APIError) as info:
        _validated(unchecked)
    assert (info.value.status, info.value.param) == (400, "n")
    assert _validated(valid) == valid
    with pytest.raises(APIError) as info:
        _validated({"model": "m", "messages": USER, "top_logprobs": 2})
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
