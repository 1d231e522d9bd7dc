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
`status`, `message`, `param`), which a caller can catch across the handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import ChatCompletion, ChatCompletionChunk
from serve_app.dialects.chat.route import CHAT
from serve_app.http.request_body import parse_request
from serve_app.transport.worker_call import accumulate, call_worker, relay


class HandleAPI:
    """Mixed into the ingress deployment: the chat row of the dialect table taken through
    the ingress's own `_prepare` (model or LoRA adapter resolved, translation, token-id and
    image checks) and the one worker call (serve_app/transport/worker_call.py), as on HTTP."""

    async def chat(self, request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletion:
        prepared = await self._prepare(CHAT, _validated(request), stream=False)
        call = await call_worker(prepared.transport, prepared.request, CHAT.param_names)
        return await accumulate(prepared.output, call)

    async def chat_stream(self, request: ChatCompletionRequest | dict[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        prepared = await self._prepare(CHAT, _validated(request), stream=True)
        call = await call_worker(prepared.transport, prepared.request, CHAT.param_names)
        # aclosing: a caller that stops early cancels the worker call now, not at garbage collection.
        async with aclosing(relay(prepared.output.chunks(call.first, call.rest), call)) as chunks:
            async for chunk in chunks:
                yield chunk


def _validated(request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletionRequest:
    """Validated as the HTTP route validates a body; a request model is validated again
    from its fields, so one built without validation (model_construct) meets every rule."""
    data = request.model_dump() if isinstance(request, ChatCompletionRequest) else request
    return parse_request(CHAT.request_model, data)
