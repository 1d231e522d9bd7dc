"""Typed Python entry points of the ingress, for other Ray apps and drivers (no HTTP).

    from ray import serve
    chat = serve.get_app_handle("chatserve")             # the app name in the Serve config
    reply = await chat.chat.remote({"model": "SmolLM2-135M-Instruct",
                                    "messages": [{"role": "user", "content": "Hi"}]})
    print(reply.choices[0].message.content)               # a serve_app.dialects.chat.request.ChatCompletion
    async for chunk in chat.options(stream=True).chat_stream.remote(request):
        ...                                               # serve_app.dialects.chat.request.ChatCompletionChunk

The request is a `ChatCompletionRequest` or a dict of the same fields, validated as
the HTTP route validates it; a bad request or a worker error raises `APIError` (with
`status`, `message`, `param`), which a caller can catch across the handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError

from serve_app.dialects.chat.output import ChunkStreamer, CompletionAccumulator
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import ChatCompletion, ChatCompletionChunk
from serve_app.dialects.chat.translate import new_request_id, to_generate_request
from serve_app.http.errors import invalid_unicode, validation_error
from serve_app.output.choice_parser import OutputParsing


class HandleAPI:
    """Mixed into the ingress deployment; uses its `_worker(model)`, `_with_images` and `config`."""

    async def chat(self, request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletion:
        req = _validated(request)
        request_id = new_request_id()
        stream = await self._call_worker(req, request_id)
        output = CompletionAccumulator(request_id, req.model, req.n, OutputParsing.of(req, self.config.model(req.model)))
        try:
            async for chunk in stream:
                output.add(chunk)
        finally:
            stream.cancel()  # no-op once finished; frees the sequence if we stop early
        return output.result()

    async def chat_stream(self, request: ChatCompletionRequest | dict[str, Any]) -> AsyncIterator[ChatCompletionChunk]:
        req = _validated(request)
        request_id = new_request_id()
        stream = await self._call_worker(req, request_id)
        streamer = ChunkStreamer(request_id, req, self.config.server.full_text_enabled,
                                 OutputParsing.of(req, self.config.model(req.model)))
        try:
            first = await anext(stream)
            async for chunk in streamer.chunks(first, stream):
                yield chunk
        finally:
            stream.cancel()

    async def _call_worker(self, req: ChatCompletionRequest, request_id: str):
        handle = self._worker(req.model)
        gen_request = await self._with_images(req.model, to_generate_request(req, request_id, self.config.model(req.model)))
        return handle.options(stream=True).generate.remote(gen_request)


def _validated(request: ChatCompletionRequest | dict[str, Any]) -> ChatCompletionRequest:
    data = request.model_dump() if isinstance(request, ChatCompletionRequest) else request
    if (error := invalid_unicode(data)) is not None:
        raise error
    if isinstance(request, ChatCompletionRequest):
        return request
    try:
        return ChatCompletionRequest.model_validate(request)
    except ValidationError as exc:
        raise validation_error(exc) from None
