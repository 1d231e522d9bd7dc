"""`/v1/messages` -> chat: a Messages request as a `/v1/chat/completions` request (whose
translation, prompt building and output parsing then apply unchanged).

- `system`: a system message first (text blocks joined);
- a user turn: its `tool_result` blocks become `tool` messages (in order, first, as the
  API wants them first), its text and image blocks one user message (images as
  `image_url` parts: base64 data as a data URL); a chat `tool` message carries text only,
  so the images a tool result holds open that user message, before the turn's own blocks;
- an assistant turn: its text, and its `tool_use` blocks as `tool_calls` (the input as
  JSON text); `thinking` blocks are left out of the prompt;
- a conversation that ends with the assistant's turn: the answer continues it
  (`continue_final_message`);
- `tool_choice`: auto / any / tool / none are auto / required / a named function / none;
  `disable_parallel_tool_use` is `parallel_tool_calls: false`;
- `thinking`: `enabled` or `adaptive` / `disabled` set the chat template's
  `enable_thinking` (Qwen3's and DeepSeek's templates read it); `enabled`'s
  `budget_tokens` is vLLM's `thinking_token_budget` (the reasoning's end tag forced once
  that many tokens think, on a model with a reasoning parser); `max_tokens` bounds
  thinking and answer together;
- `output_config.format` (a JSON schema): the chat `response_format`;
- `stop_sequences`, `temperature`, `top_p`, `top_k`, `metadata.user_id`: `stop`,
  `temperature`, `top_p`, `top_k`, `user`; vLLM's `structured_outputs` and `guided_*`
  fields: passed on as they are.
"""

from __future__ import annotations

import json
import uuid
from contextlib import AbstractContextManager
from typing import Any

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.messages.request import (
    ImageBlock,
    Message,
    MessagesRequest,
    TextBlock,
    ThinkingDisabled,
    ThinkingEnabled,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceTool,
    ToolResultBlock,
    ToolUseBlock,
)
from serve_app.http.errors import params_renamed
from serve_app.http.request_body import parse_request

# The worker names the chat request's fields in its errors; these are the Messages names.
WORKER_PARAM_NAMES = {"stop": "stop_sequences", "response_format": "output_config.format"}


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    """The chat request that asks the same (see the module docstring)."""
    body: dict[str, Any] = {
        "model": req.model,
        "messages": system_messages(req) + chat_messages(req.messages),
        "stream": req.stream,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stop": req.stop_sequences,
        "user": req.metadata.user_id if req.metadata else None,
    }
    if req.ends_with_assistant:
        body.update(add_generation_prompt=False, continue_final_message=True)
    if req.tools:
        body["tools"] = [{"type": "function", "function": _function(tool)} for tool in req.tools]
    if req.tool_choice is not None:
        body.update(_tool_choice(req))
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": not isinstance(req.thinking, ThinkingDisabled)}
    if isinstance(req.thinking, ThinkingEnabled):
        body["thinking_token_budget"] = req.thinking.budget_tokens
    body.update(req.structured_fields())
    fmt = req.output_config.format if req.output_config else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    with messages_params():
        return parse_request(ChatCompletionRequest, body)


def system_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    if not req.system:
        return []
    text = req.system if isinstance(req.system, str) else "\n\n".join(block.text for block in req.system)
    return [{"role": "system", "content": text}]


def chat_messages(messages: list[Message]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for message in messages:
        out += _assistant_turn(message) if message.role == "assistant" else _user_turn(message)
    return out


def _user_turn(message: Message) -> list[dict[str, Any]]:
    blocks = message.blocks
    results = [b for b in blocks if isinstance(b, ToolResultBlock)]
    out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": _result_text(b)} for b in results]
    rest = [part for b in results if not isinstance(b.content, str) for part in b.content
            if isinstance(part, ImageBlock)]  # the results' images first
    rest += [b for b in blocks if not isinstance(b, ToolResultBlock)]
    if not rest:
        return out
    if any(isinstance(b, ImageBlock) for b in rest):
        parts = [{"type": "image_url", "image_url": {"url": b.url}} if isinstance(b, ImageBlock)
                 else {"type": "text", "text": b.text} for b in rest]
        return out + [{"role": "user", "content": parts}]
    return out + [{"role": "user", "content": "".join(b.text for b in rest)}]


def _result_text(block: ToolResultBlock) -> str:
    """A tool result's text (its images go to the user message after it: _user_turn)."""
    if isinstance(block.content, str):
        text = block.content
    else:
        text = "".join(part.text for part in block.content if isinstance(part, TextBlock))
    return f"Error: {text}" if block.is_error else text


def _assistant_turn(message: Message) -> list[dict[str, Any]]:
    text = "".join(b.text for b in message.blocks if isinstance(b, TextBlock))
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in message.blocks if isinstance(b, ToolUseBlock)]
    turn: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        turn["tool_calls"] = calls
    return [turn]


def _function(tool: Any) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.input_schema,
                "strict": tool.strict}
    return {key: value for key, value in function.items() if value is not None}


def _tool_choice(req: MessagesRequest) -> dict[str, Any]:
    choice = req.tool_choice
    if isinstance(choice, ToolChoiceTool):
        fields: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": choice.name}}}
    elif isinstance(choice, ToolChoiceAny):
        fields = {"tool_choice": "required"}
    else:
        fields = {"tool_choice": choice.type}  # auto, none
    if isinstance(choice, (ToolChoiceAuto, ToolChoiceAny, ToolChoiceTool)) and choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    return fields


# ------------------------------------------------------------------ errors in Messages terms

_CHAT_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences",
                "response_format": "output_config.format", "user": "metadata.user_id"}


def messages_param(param: str) -> str:
    """A chat request's field as the Messages field it came from (`tools.0.function.parameters`
    -> `tools.0.input_schema`; a chat message index says nothing about `messages`', so it is dropped)."""
    head, _, rest = param.partition(".")
    if head == "tools" and ".function" in param:
        return param.replace(".function", "", 1).replace(".parameters", ".input_schema", 1)
    if head in ("messages", "continue_final_message", "add_generation_prompt"):
        return "messages"  # a chat message index (or the ending) says nothing about the turns
    if head in _CHAT_PARAMS:
        renamed = _CHAT_PARAMS[head]
        return f"{renamed}.{rest}" if rest else renamed
    return param


def messages_params() -> AbstractContextManager[None]:
    """Errors raised by the chat path (validation, grammars, images) name Messages fields."""
    return params_renamed(messages_param)
