"""`/v1/messages` (Anthropic's Messages API) as a row of the dialect table: the chat request
it becomes, the output that answers it, its errors in Anthropic's shape; and what
`/v1/messages/count_tokens` sends the worker's tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from serve_app.dialects.chat import translate as chat_translate
from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.messages.output import (
    MessageAccumulator,
    MessageBuilder,
    MessageStreamer,
)
from serve_app.dialects.messages.request import MessagesRequest
from serve_app.dialects.messages.response import error_response
from serve_app.dialects.messages.translate import (
    WORKER_PARAM_NAMES,
    messages_params,
    new_message_id,
    to_chat_request,
)
from serve_app.output.choice_parser import OutputParsing
from serve_app.schema.dialect import CallContext, Dialect
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest

COUNT_TOKENS_PATH = "/v1/messages/count_tokens"


@dataclass
class MessagesCall:
    chat: ChatCompletionRequest  # what the chat path translates for the worker
    builder: MessageBuilder


def plan(req: MessagesRequest, message_id: str, context: CallContext) -> MessagesCall:
    """The chat request and the output's builder; a broken rule of the chat path is a 400
    naming the Messages field."""
    chat = to_chat_request(req)
    return MessagesCall(chat, MessageBuilder(message_id, req, OutputParsing.of(chat, context.model)))


def to_generate_request(call: MessagesCall, message_id: str, model: ModelConfig | None) -> GenerateRequest:
    return chat_translate.to_generate_request(call.chat, message_id, model)


def output(call: MessagesCall, message_id: str, context: CallContext,
           stream: bool) -> MessageStreamer | MessageAccumulator:
    return MessageStreamer(call.builder) if stream else MessageAccumulator(call.builder)


def count_tokens_fields(req: MessagesRequest) -> dict[str, Any]:
    """/tokenize's body (serve_app/dialects/tokenization.py) for the prompt a Messages request
    becomes: its system, messages and tools, templated as generation templates them."""
    chat = to_chat_request(req)
    return {"model": chat.model, "messages": [m.model_dump(exclude_none=True) for m in chat.messages],
            "tools": [t.model_dump(exclude_none=True) for t in chat.tools_in_play] or None,
            "chat_template_kwargs": chat.chat_template_kwargs,
            "add_generation_prompt": chat.add_generation_prompt,
            "continue_final_message": chat.continue_final_message}


MESSAGES = Dialect(path="/v1/messages", request_model=MessagesRequest, new_id=new_message_id, plan=plan,
                   translate=to_generate_request, output=output, param_names=WORKER_PARAM_NAMES,
                   errors=messages_params, error_response=error_response)
