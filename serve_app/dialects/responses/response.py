"""`/v1/responses` response models: the `response` object, its output items and usage.

Every field is always written (no `exclude_unset`): the Responses API writes nulls.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class OutModel(BaseModel):
    def dump(self) -> dict:
        return self.model_dump(by_alias=True)

    def dump_json(self) -> str:
        return self.model_dump_json(by_alias=True)


Status = Literal["in_progress", "completed", "incomplete"]


class OutputTextPart(OutModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ReasoningTextPart(OutModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageOutput(OutModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Status
    content: list[OutputTextPart]


class FunctionCallOutput(OutModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str  # JSON text
    status: Status


class ReasoningOutput(OutModel):
    """The model's reasoning as `content` (reasoning_text parts, as vLLM writes it); no
    `summary`: this server does not summarise."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextPart]
    status: Status


OutputItem = Annotated[MessageOutput | FunctionCallOutput | ReasoningOutput, Field(discriminator="type")]


class InputTokensDetails(OutModel):
    cached_tokens: int  # served from the prefix cache
    cache_write_tokens: int = 0  # OpenAI's billed cache writes: none here (the SDK's types require it)


class OutputTokensDetails(OutModel):
    reasoning_tokens: int


class ResponseUsage(OutModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(OutModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OutModel):
    code: str
    message: str


class ReasoningConfig(OutModel):
    effort: str | None = None
    summary: str | None = None


class Response(OutModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: ReasoningConfig = Field(default_factory=ReasoningConfig)
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None
    metadata: dict[str, str]
