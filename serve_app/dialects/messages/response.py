"""`/v1/messages` answer models: the `message` object, its content blocks and usage, and
Anthropic's error shape (`{"type": "error", "error": {"type", "message"}}`)."""

from __future__ import annotations

from typing import Any, Literal

from starlette.responses import JSONResponse

from serve_app.http.errors import APIError
from serve_app.schema.common import ResponseModel


class TextOut(ResponseModel):
    type: Literal["text"] = "text"
    text: str


class ThinkingOut(ResponseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's signs its reasoning; a local model's has nothing to sign


class ToolUseOut(ResponseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = TextOut | ThinkingOut | ToolUseOut

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesUsage(ResponseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # prompt tokens served from the prefix cache


class MessageOut(ResponseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessagesUsage

    def dump(self) -> dict:
        # Every field, defaults included: a `message_start` shows them all, as Anthropic's does.
        return self.model_dump()

    def dump_json(self) -> str:
        return self.model_dump_json()


class TokenCount(ResponseModel):
    input_tokens: int


# Anthropic's error types by status code (what its SDKs and agents branch on).
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: APIError) -> dict[str, Any]:
    """The error in Anthropic's shape; its type follows the status, as Anthropic's does."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: APIError) -> JSONResponse:
    return error.response(error_body(error))
