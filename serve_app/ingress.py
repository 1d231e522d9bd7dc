"""The Ray Serve ingress deployment: HTTP routes, validation, streaming, errors.

It holds no model: each request is validated here, then sent to the worker
deployment of the requested model through a streaming `DeploymentHandle` call. The
first worker chunk is awaited before the response starts, so errors found by the
worker (context window, template) still get their own status code; after that,
errors travel as a final SSE event before `[DONE]`.
"""


import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from pydantic import ValidationError
from ray import serve
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.responses import JSONResponse, Response, StreamingResponse

from serve_app.chat_completions import (
    ChunkStreamer,
    CompletionAccumulator,
    new_request_id,
    to_generate_request,
)
from serve_app.config import AppConfig
from serve_app.errors import APIError, not_found_model, validation_error
from serve_app.protocol import ChatCompletionRequest, ModelCard, ModelList
from workers.protocol import GenerationChunk, ModelInfo

logger = logging.getLogger("chatserve.ingress")

api = FastAPI(title="chatserve", version="0.1.0")


@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


@api.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error")
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error").response()


async def read_json_body(request: Request, limit: int) -> dict:
    body = await request.body()
    if len(body) > limit:
        raise APIError(413, f"request body is {len(body)} bytes; the limit is {limit}", code="request_too_large")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    return data


async def _cancel_on_exit(events: AsyncIterator[str], stream) -> AsyncIterator[str]:
    """Forward SSE events; if the client leaves early, cancel the worker call too."""
    finished = False
    try:
        async for event in events:
            yield event
        finished = True
    finally:
        if not finished:
            stream.cancel()


@serve.deployment(name="ChatIngress")
@serve.ingress(api)
class ChatIngress:
    def __init__(self, app_config: dict, workers: dict[str, DeploymentHandle]) -> None:
        self.config = AppConfig.model_validate(app_config)
        self.workers = workers
        self._infos: dict[str, ModelInfo] = {}
        self.created = int(time.time())

    @api.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @api.get("/v1/models")
    async def list_models(self) -> Response:
        cards = []
        for model_id in self.workers:
            info = await self._info(model_id)
            cards.append(
                ModelCard(id=model_id, object="model", created=self.created, owned_by="chatserve",
                          max_model_len=info.max_model_len)
            )
        return Response(ModelList(object="list", data=cards).dump_json(), media_type="application/json")

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        data = await read_json_body(request, self.config.server.max_request_bytes)
        try:
            req = ChatCompletionRequest.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None
        handle = self._worker(req.model)
        request_id = new_request_id()
        gen_request = to_generate_request(req, request_id)
        stream = handle.options(stream=True).generate.remote(gen_request)
        first = await self._first_chunk(stream)
        if req.stream:
            streamer = ChunkStreamer(request_id, req, self.config.server.full_text_enabled)
            return StreamingResponse(_cancel_on_exit(streamer.events(first, stream), stream),
                                     media_type="text/event-stream")
        acc = CompletionAccumulator(request_id, req.model)
        acc.add(first)
        async for chunk in stream:
            acc.add(chunk)
        return Response(acc.result().dump_json(), media_type="application/json")

    def _worker(self, model: str) -> DeploymentHandle:
        handle = self.workers.get(model)
        if handle is None:
            raise not_found_model(model, list(self.workers))
        return handle

    async def _first_chunk(self, stream) -> GenerationChunk:
        try:
            first = await stream.__anext__()
        except BackPressureError as exc:
            raise APIError(503, f"server overloaded, retry later ({exc})", type="server_error",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except StopAsyncIteration:
            raise APIError(500, "the worker ended the request without output", type="internal_error") from None
        if first.error is not None:
            stream.cancel()
            raise APIError.from_info(first.error)
        return first

    async def _info(self, model_id: str) -> ModelInfo:
        if model_id not in self._infos:
            self._infos[model_id] = await self.workers[model_id].info.remote()
        return self._infos[model_id]
