"""`/v1/responses` <-> chat: a Responses request as a `/v1/chat/completions` request (whose
translation, prompt building and output parsing then apply unchanged), and output items
as the chat messages a later turn continues from.

- `instructions`: a system message first (not carried over from a previous response);
- message items: chat messages (`developer` is `system`, which every chat template knows);
  text parts joined into one string, images as `image_url` parts;
- `function_call` items: `tool_calls` of an assistant message (calls in a row, or right
  after the assistant's text, share one message); `function_call_output`: a `tool` message;
- `reasoning` items: left out of the prompt;
- `text.format`: the chat `response_format`, except with a forced call (`tool_choice`
  required or a function), whose answer has no text to format;
- vLLM's `structured_outputs` and `guided_*` fields: passed on as they are.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.responses.request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputImage,
    MessageItem,
    ResponsesRequest,
    TextFormatJSONObject,
    TextFormatJSONSchema,
)
from serve_app.dialects.responses.response import (
    FunctionCallOutput,
    MessageOutput,
    OutputItem,
)
from serve_app.http.errors import params_renamed
from serve_app.http.request_body import parse_request

# The worker names the chat request's fields in its errors; these are the Responses names.
WORKER_PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def to_chat_request(req: ResponsesRequest, history: Sequence[dict[str, Any]] = ()) -> ChatCompletionRequest:
    """The chat request that asks the same; `history`: the stored conversation of
    `previous_response_id` (chat messages), which goes between the instructions and `input`."""
    instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
    body: dict[str, Any] = {
        "model": req.model,
        "messages": instructions + list(history) + input_messages(req),
        "stream": req.stream,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "seed": req.seed,
        "user": req.user,
        "parallel_tool_calls": req.parallel_tool_calls,
    }
    if req.tools:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, FunctionToolChoice) else choice)
    body.update(req.structured_fields())
    forced = req.tool_choice == "required" or isinstance(req.tool_choice, FunctionToolChoice)
    if (fmt := response_format(req)) is not None and not forced:
        # A forced call leaves no text to format (agents send their output format on every
        # turn); the chat path takes one grammar a request, so it is the calls'.
        body["response_format"] = fmt
    with responses_params():
        return parse_request(ChatCompletionRequest, body)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The input items as chat messages (see the module docstring)."""
    messages: list[dict[str, Any]] = []
    for item in req.input:
        if isinstance(item, MessageItem):
            messages.append(_message(item))
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item.call_id, item.name, item.arguments)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return messages


def output_messages(items: Sequence[OutputItem]) -> list[dict[str, Any]]:
    """A response's output as the chat messages that continue the conversation."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageOutput):
            messages.append({"role": "assistant", "content": "".join(p.text for p in item.content)})
        elif isinstance(item, FunctionCallOutput):
            _add_call(messages, item.call_id, item.name, item.arguments)
    return messages


def _message(item: MessageItem) -> dict[str, Any]:
    role = "system" if item.role == "developer" else item.role
    if not any(isinstance(p, InputImage) for p in item.content):
        return {"role": role, "content": "".join(_part_text(p) for p in item.content)}
    parts = [{"type": "image_url", "image_url": {"url": p.image_url, **({"detail": p.detail} if p.detail else {})}}
             if isinstance(p, InputImage) else {"type": "text", "text": _part_text(p)}
             for p in item.content]
    return {"role": role, "content": parts}


def _part_text(part: Any) -> str:
    return part.refusal if part.type == "refusal" else part.text


def _add_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    """`text.format` as the chat `response_format` (None for text)."""
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, TextFormatJSONObject):
        return {"type": "json_object"}
    if isinstance(fmt, TextFormatJSONSchema):
        spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict, "description": fmt.description}
        return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}
    return None


# ------------------------------------------------------------------ errors in chat terms

_CHAT_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format"}


def responses_param(param: str) -> str:
    """A chat request's field as the Responses field it came from (`tools.0.function.name`
    -> `tools.0.name`; a message index says nothing about `input`'s, so it is dropped)."""
    head, _, rest = param.partition(".")
    if head == "tools" and ".function" in param:
        return param.replace(".function", "", 1)
    if head in _CHAT_PARAMS:
        renamed = _CHAT_PARAMS[head]
        return renamed if head == "messages" or not rest else f"{renamed}.{rest}"
    return param


def responses_params() -> AbstractContextManager[None]:
    """Errors raised by the chat path (validation, grammars, images) name Responses fields."""
    return params_renamed(responses_param)
