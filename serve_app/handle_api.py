"""Typed Python entry points of the ingress, for other Ray apps and drivers (no HTTP).

    from ray import serve
    chat = serve.get_app_handle("chatserve")             # the app name in the Serve config
    reply = await chat.chat.remote({"model": "SmolLM2-135M-Instruct",
                                    "messages": [{"role": "user", "content": "Hi"}]})
    print(reply.choices[0].message.content)               # a serve_app.dialects.chat.response.ChatCompletion
    async for chunk in chat.options(stream=True).chat_stream.remote(request):
        ...                                               # serve_app.dialects.chat.response.ChatCompletionChunk

The request is a `ChatCompletionRequest` or a dict of the same fields, validated as
the HTTP route validates it; a bad request or a worker error raises `APIError` (with
`status`, `message`, `param`), which a caller can catch across the handle. A call is
counted in /metrics and the request log as route `handle:chat`, and traced when
`server.tracing` is set (under the caller's `traceparent`, given as `trace_headers`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from typing import Any

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import ChatCompletion, ChatCompletionChunk
from serve_app.dialects.chat.route import CHAT
from serve_app.http.errors import APIError
from serve_app.http.metrics import STATUS_CLIENT_GONE, RequestRecord
from serve_app.http.request_body import parse_request
from serve_app.transport.worker_call import WorkerCall, accumulate, call_worker, relay

HANDLE_ROUTE = "handle:chat"  # the handle calls' route label in /metrics, the request log and spans


class HandleAPI:
    """Mixed into the ingress deployment: the chat row of the dialect table taken through
    the ingress's own `_prepare` (model or LoRA adapter resolved, translation, token-id and
    image checks) and the one worker call (serve_app/transport/worker_call.py), as on HTTP,
    with the HTTP routes' metrics record and spans."""

    async def chat(self, request: ChatCompletionRequest | dict[str, Any],
                   trace_headers: Mapping[str, str] | None = None) -> ChatCompletion:
        record = self._handle_record(trace_headers)
        try:
            output, call = await self._handle_call(record, request, stream=False)
            result = await accumulate(output, call)
        except BaseException as exc:
            _finish_failed(record, exc)
            raise
        record.finish(200)
        return result

    async def chat_stream(self, request: ChatCompletionRequest | dict[str, Any],
                          trace_headers: Mapping[str, str] | None = None) -> AsyncIterator[ChatCompletionChunk]:
        record = self._handle_record(trace_headers)
        try:
            output, call = await self._handle_call(record, request, stream=True)
        except BaseException as exc:
            _finish_failed(record, exc)
            raise
        # aclosing: a caller that stops early cancels the worker call now, not at garbage
        # collection; relay finishes the record (200, 499 when the caller left, 500).
        async with aclosing(relay(output.chunks(call.first, call.rest), call, record)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _handle_record(self, trace_headers: Mapping[str, str] | None) -> RequestRecord:
        record = self.metrics.begin(HANDLE_ROUTE)
        if self.tracing is not None:
            record.trace = self.tracing.begin(record, "CALL", trace_headers or {})
        return record

    async def _handle_call(self, record: RequestRecord, request: ChatCompletionRequest | dict[str, Any],
                           stream: bool) -> tuple[Any, WorkerCall]:
        """The call's first chunk in: the dialect's accumulator or streamer, and the call."""
        req = _validated(request)
        record.set_request(req)
        prepared = await self._prepare(CHAT, req, stream=stream)
        record.request_id = prepared.request_id
        gen_request = prepared.request
        if record.trace is not None:
            (gen_request,) = record.trace.worker_requests((gen_request,), req.model)
        call = await call_worker(prepared.transport, gen_request, CHAT.param_names, record)
        if record.trace is not None:
            record.trace.first_chunk()
        return prepared.output, call


def _finish_failed(record: RequestRecord, exc: BaseException) -> None:
    """A call that failed before its output: the error's status, 499 for a caller gone."""
    if isinstance(exc, APIError):
        record.fail(exc.status, exc.type)
    elif isinstance(exc, asyncio.CancelledError):
        record.finish(STATUS_CLIENT_GONE)
    else:
        record.fail(500, "internal_error")


def _validated(request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletionRequest:
    """Validated as the HTTP route validates a body; a request model is validated again
    from its fields, so one built without validation (model_construct) meets every rule."""
    data = request.model_dump() if isinstance(request, ChatCompletionRequest) else request
    return parse_request(CHAT.request_model, data)
