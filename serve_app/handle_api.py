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

from serve_app.dialects.chat.output import ChunkStreamer, CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import ChatCompletion, ChatCompletionChunk
from serve_app.dialects.chat.translate import new_request_id
from serve_app.http.request_body import parse_request
from serve_app.lora_adapters import Target
from serve_app.output.choice_parser import OutputParsing
from serve_app.worker_call import WorkerCall, accumulate, call_worker, relay


class HandleAPI:
    """Mixed into the ingress deployment; uses its `_worker(model)`, `_chat_generate_request`,
    `adapters` and `config`. Worker calls go through serve_app/worker_call.py, as HTTP
    requests do; `model` may name a LoRA adapter, as on HTTP."""

    async def chat(self, request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletion:
        req = _validated(request)
        request_id = new_request_id()
        target = await self.adapters.resolve(req.model)
        call = await self._call_worker(req, request_id, target)
        parsing = OutputParsing.of(req, self.config.model(target.base_model))
        output = CompletionAccumulator(request_id, req.model, req.n, parsing)
        return await accumulate(output, call)

    async def chat_stream(self, request: ChatCompletionRequest | dict[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        req = _validated(request)
        request_id = new_request_id()
        target = await self.adapters.resolve(req.model)
        call = await self._call_worker(req, request_id, target)
        streamer = ChunkStreamer(request_id, req, self.config.server.full_text_enabled,
                                 OutputParsing.of(req, self.config.model(target.base_model)))
        # aclosing: a caller that stops early cancels the worker call now, not at garbage collection.
        async with aclosing(relay(streamer.chunks(call.first, call.rest), call)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _call_worker(self, req: ChatCompletionRequest, request_id: str, target: Target) -> WorkerCall:
        transport = self._worker(target.base_model)
        return await call_worker(transport, await self._chat_generate_request(req, request_id, target))


def _validated(request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletionRequest:
    """Validated as the HTTP route validates a body; a request model is validated again
    from its fields, so one built without validation (model_construct) meets every rule."""
    data = request.model_dump() if isinstance(request, ChatCompletionRequest) else request
    return parse_request(ChatCompletionRequest, data)
