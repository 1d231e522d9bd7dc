"""What `POST /v1/responses` does before and after the worker call: the stored conversation
it continues, the chat request it becomes, and the output that answers it; its row of the
dialect table."""

from __future__ import annotations

from dataclasses import dataclass

from serve_app.config.app_config import ServerOptions
from serve_app.dialects.chat import translate as chat_translate
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
from serve_app.schema.dialect import CallContext, Dialect
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest


@dataclass
class ResponsesCall:
    chat: ChatCompletionRequest  # what the chat path translates for the worker
    builder: ResponseBuilder
    save: Saver | None  # stores the answer (`store: true` and a store on this replica)


def new_store(server: ServerOptions) -> ResponseStore:
    """This ingress replica's store of responses (the dialect's state)."""
    return ResponseStore(server.responses.store_max_entries, server.responses.store_max_bytes)


def plan(req: ResponsesRequest, response_id: str, context: CallContext) -> ResponsesCall:
    """The chat request and the output's builder of a Responses request; a `previous_response_id`
    not in the store is a 404, a broken rule of the chat path a 400 naming the Responses field."""
    store: ResponseStore = context.state
    history = store.get(req.previous_response_id).messages() if req.previous_response_id else []
    chat = to_chat_request(req, history)
    stored = req.store and store.enabled
    builder = ResponseBuilder(response_id, req, OutputParsing.of(chat, context.model), stored)
    save = _saver(store, history + input_messages(req)) if stored else None
    return ResponsesCall(chat, builder, save)


def to_generate_request(call: ResponsesCall, response_id: str, model: ModelConfig | None) -> GenerateRequest:
    """The chat path's translation of the planned chat request."""
    return chat_translate.to_generate_request(call.chat, response_id, model)


def output(call: ResponsesCall, response_id: str, context: CallContext,
           stream: bool) -> ResponseStreamer | ResponseAccumulator:
    return ResponseStreamer(call.builder, call.save) if stream else ResponseAccumulator(call.builder, call.save)


def _saver(store: ResponseStore, conversation: list[dict]) -> Saver:
    def save(response: Response) -> None:
        store.put(response, conversation + output_messages(response.output))
    return save


# `errors`: errors of the chat path (grammars, token ids, images) name Responses fields.
RESPONSES = Dialect(path="/v1/responses", request_model=ResponsesRequest, new_id=new_response_id, plan=plan,
                    translate=to_generate_request, output=output, param_names=WORKER_PARAM_NAMES,
                    errors=responses_params, state=new_store)
