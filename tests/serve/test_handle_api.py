"""The typed Python handle API, called from a second Serve app (no HTTP anywhere)."""

from __future__ import annotations

import sys

import pytest
from ray import cloudpickle, serve

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import ChatCompletion, ChatCompletionChunk
from serve_app.http.errors import APIError
from tests.support.serve_fixtures import TINY_MODEL_ID, delete_app

# Ray workers cannot import the tests package: ship this module's classes by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

REQUEST = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}],
           "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@serve.deployment
class Caller:
    """Another team's Ray app: it reaches chatserve through its app handle only."""

    def __init__(self, app_name: str) -> None:
        self.chat = serve.get_app_handle(app_name)

    async def ask(self, request: dict) -> ChatCompletion:
        return await self.chat.chat.remote(request)

    async def ask_typed(self, request: dict) -> ChatCompletion:
        return await self.chat.chat.remote(ChatCompletionRequest.model_validate(request))

    async def ask_stream(self, request: dict) -> list[ChatCompletionChunk]:
        stream = self.chat.options(stream=True).chat_stream.remote(request)
        return [chunk async for chunk in stream]

    async def ask_bad(self, request: dict) -> tuple[int, str | None]:
        try:
            await self.chat.chat.remote(request)
        except APIError as exc:
            return exc.status, exc.param
        return 200, None


@pytest.fixture(scope="module")
def caller(tiny_app):
    handle = serve.run(Caller.bind("tiny"), name="caller", route_prefix=None)
    yield handle
    delete_app("caller")


def test_chat_returns_a_typed_response(caller, tiny_app):
    import httpx

    reply = caller.ask.remote(REQUEST).result()
    assert isinstance(reply, ChatCompletion)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 6
    over_http = httpx.post(tiny_app + "/v1/chat/completions", json=REQUEST, timeout=60).json()
    assert reply.choices[0].message.content == over_http["choices"][0]["message"]["content"]
    assert caller.ask_typed.remote(REQUEST).result().choices[0].message.content == reply.choices[0].message.content


def test_chat_stream_yields_chunks(caller):
    whole = caller.ask.remote(REQUEST).result().choices[0].message.content
    chunks = caller.ask_stream.remote({**REQUEST, "stream": True}).result()
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"


def test_errors_arrive_as_api_errors(caller):
    assert caller.ask_bad.remote({**REQUEST, "temperature": 7}).result() == (400, "temperature")
    assert caller.ask_bad.remote({**REQUEST, "model": "nope"}).result() == (404, "model")
    assert caller.ask_bad.remote({**REQUEST, "max_tokens": 10_000}).result() == (400, "max_tokens")


def test_handle_calls_are_counted_in_the_ingress_metrics(caller, tiny_app):
    """Route `handle:chat` in /metrics, by status: calls that answered and one refused."""
    import re

    import httpx

    def counted(status: str) -> float:
        text = httpx.get(tiny_app + "/metrics", timeout=30).text
        pattern = rf'chatserve_requests_total\{{[^}}]*route="handle:chat"[^}}]*status="{status}"[^}}]*\}} ([\d.]+)'
        return sum(float(value) for value in re.findall(pattern, text))

    before_ok, before_bad = counted("200"), counted("400")
    caller.ask.remote(REQUEST).result()
    caller.ask_stream.remote({**REQUEST, "stream": True}).result()
    assert caller.ask_bad.remote({**REQUEST, "temperature": 7}).result() == (400, "temperature")
    assert counted("200") - before_ok == 2 and counted("400") - before_bad == 1
