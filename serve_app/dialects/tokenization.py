"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): request and response models,
and the worker messages they become (workers/contract/tokenize.py).

- /tokenize takes `model` and either `prompt` (`add_special_tokens`, default true) or
  `messages` (templated exactly as /v1/chat/completions templates them: `tools` and
  `chat_template_kwargs` too; `add_generation_prompt` default true,
  `continue_final_message` default false, not both; `add_special_tokens` default false,
  since the template writes them), and `return_token_strs`. It answers
  `{count, max_model_len, tokens, token_strs}` (`token_strs` null unless asked); a prompt
  longer than the context window is counted, not refused. Image parts are a 400.
- /detokenize takes `model` and `tokens` and answers `{prompt}`: the text of the ids,
  special tokens included. Ids outside the vocabulary are a 400 naming `tokens`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, model_validator

from serve_app.dialects.chat.request import ChatMessage
from serve_app.http.errors import APIError, field_rule
from serve_app.media.images import first_image_param
from serve_app.output.tool_parsers import PARSERS
from serve_app.schema.common import RequestModel, ResponseModel, field_error, or_default
from serve_app.schema.tools import Tool
from workers.contract.model_config import ModelConfig
from workers.contract.tokenize import DetokenizeRequest, TokenizeRequest, TokenizeResult


class TokenizeBody(RequestModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt` or `messages`."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM's defaults)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeBody":
        if self.prompt is None and self.messages is None:
            raise field_rule(field_error("prompt", "one of prompt or messages is required"))
        if self.prompt is not None and self.messages is not None:
            raise field_rule(field_error("messages", "send prompt or messages, not both"))
        if self.continue_final_message and self.add_generation_prompt:
            raise field_rule(field_error("continue_final_message", "continue_final_message and "
                                         "add_generation_prompt cannot both be true"))
        return self


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeBody(RequestModel):
    model: str
    tokens: list[Annotated[int, Field(ge=0)]]


class DetokenizeResponse(ResponseModel):
    prompt: str


def to_tokenize_request(req: TokenizeBody, model: ModelConfig) -> TokenizeRequest:
    """The worker's message; a chat's fields are packed as chat/translate.py packs a chat
    request's (tests/unit/api/test_tokenization_dialect.py holds them equal)."""
    token_strs = bool(req.return_token_strs)
    if req.prompt is not None:
        return TokenizeRequest(prompt=req.prompt, add_special_tokens=or_default(req.add_special_tokens, True),
                               return_token_strs=token_strs)
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    if (param := first_image_param(messages)) is not None:
        raise APIError(400, f"{param}: /tokenize counts text only; image parts are not supported", param=param,
                       code="unsupported_parameter")
    tools = list(req.tools or [])
    return TokenizeRequest(
        messages=messages,
        add_special_tokens=or_default(req.add_special_tokens, False),
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
        tools=[t.model_dump(exclude_none=True) for t in tools] or None,
        tool_prompt=PARSERS[model.tool_call_parser].tool_prompt(tools),
        return_token_strs=token_strs,
    )


def tokenize_response(result: TokenizeResult) -> TokenizeResponse:
    return TokenizeResponse(count=len(result.tokens), max_model_len=result.max_model_len, tokens=result.tokens,
                            token_strs=result.token_strs)


def to_detokenize_request(req: DetokenizeBody) -> DetokenizeRequest:
    return DetokenizeRequest(list(req.tokens))
