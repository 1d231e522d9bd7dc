"""What `POST /v1/responses` does before and after the worker call: the stored conversation
it continues, the chat request it becomes, and the output that answers it."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.responses.output import (
    ResponseAccumulator,
    ResponseBuilder,
    ResponseStreamer,
    Saver,
)
from serve_app.dialects.responses.request import ResponsesRequest
from serve_app.dialects.responses.response import Response
from serve_app.dialects.responses.store import ResponseStore
from serve_app.dialects.responses.translate import (
    WORKER_PARAM_NAMES,
    input_messages,
    new_response_id,
    output_messages,
    responses_params,
    to_chat_request,
)
from serve_app.output.choice_parser import OutputParsing
from workers.contract.model_config import ModelConfig

# What the ingress needs of the dialect besides `plan`.
__all__ = ["WORKER_PARAM_NAMES", "ResponsesCall", "new_response_id", "plan", "responses_params"]


@dataclass
class ResponsesCall:
    chat: ChatCompletionRequest  # what the chat path translates for the worker
    output: ResponseStreamer | ResponseAccumulator


def plan(req: ResponsesRequest, response_id: str, store: ResponseStore, model: ModelConfig | None) -> ResponsesCall:
    """The chat request and the output of a Responses request; a `previous_response_id`
    not in `store` is a 404, a broken rule of the chat path a 400 naming the Responses field."""
    history = store.get(req.previous_response_id).messages() if req.previous_response_id else []
    chat = to_chat_request(req, history)
    stored = req.store and store.enabled
    builder = ResponseBuilder(response_id, req, OutputParsing.of(chat, model), stored)
    save = _saver(store, history + input_messages(req)) if stored else None
    output = ResponseStreamer(builder, save) if req.stream else ResponseAccumulator(builder, save)
    return ResponsesCall(chat, output)


def _saver(store: ResponseStore, conversation: list[dict]) -> Saver:
    def save(response: Response) -> None:
        store.put(response, conversation + output_messages(response.output))
    return save
