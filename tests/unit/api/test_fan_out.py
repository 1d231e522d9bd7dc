"""A request split over several worker calls (serve_app/transport/fan_out.py): the merged
stream's choice indexes and usage, an error in a call's first chunk or later, and
cancellation reaching every call."""

from __future__ import annotations

import asyncio

import pytest

from serve_app.http.errors import APIError
from serve_app.transport.fan_out import fan_out
from serve_app.transport.worker_call import WorkerCall
from workers.contract.chunks import GenerationChunk


class Stream:
    """A call's chunks after its first; an exception in the list is raised there."""

    def __init__(self, items: list) -> None:
        self.items, self.cancelled = list(items), False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> GenerationChunk:
        await asyncio.sleep(0)
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


def chunk(index: int, text: str, done: int, prompt: int, cached: int | None = None, finish: str | None = None):
    return GenerationChunk(index=index, text=text, prompt_tokens=prompt, completion_tokens=done, cached_tokens=cached,
                           finish_reason=finish)


def starts(calls: list[WorkerCall | BaseException]):
    async def start(call):
        if isinstance(call, BaseException):
            raise call
        return call
    return [lambda call=call: start(call) for call in calls]


def test_choices_are_numbered_by_call_and_usage_counts_every_call():
    first = WorkerCall(chunk(0, "a", 1, prompt=5), Stream([chunk(1, "b", 2, 5, cached=4), chunk(0, "c", 3, 5,
                                                                                                  finish="stop")]))
    second = WorkerCall(chunk(1, "x", 1, prompt=7), Stream([chunk(0, "y", 2, 7, finish="length")]))

    async def run():
        merged = await fan_out(starts([first, second]), choices_per_call=2)
        return [c async for c in merged]

    out = asyncio.run(run())
    assert [(c.index, c.text) for c in out[:2]] == [(0, "a"), (3, "x")]  # the first chunks, in call order
    assert sorted((c.index, c.text) for c in out[2:]) == [(0, "c"), (1, "b"), (2, "y")]
    assert all(c.prompt_tokens == 12 for c in out)
    assert out[-1].completion_tokens == 5 and out[1].cached_tokens is None
    assert max(c.cached_tokens or 0 for c in out) == 4


def test_an_error_in_a_first_chunk_cancels_the_others():
    ok = WorkerCall(chunk(0, "a", 1, 3), Stream([]))

    async def run():
        await fan_out(starts([ok, APIError(400, "too long", param="prompt")]), choices_per_call=1)

    with pytest.raises(APIError, match="too long"):
        asyncio.run(run())
    assert ok.rest.cancelled


def test_a_later_failure_is_raised_and_cancel_reaches_every_call():
    broken = WorkerCall(chunk(0, "a", 1, 3), Stream([RuntimeError("replica died")]))
    slow = WorkerCall(chunk(0, "b", 1, 3), Stream([chunk(0, "c", 2, 3)] * 50))

    async def run():
        merged = await fan_out(starts([broken, slow]), choices_per_call=1)
        return [c.text async for c in merged]

    with pytest.raises(RuntimeError, match="replica died"):
        asyncio.run(run())
    assert broken.rest.cancelled and slow.rest.cancelled
