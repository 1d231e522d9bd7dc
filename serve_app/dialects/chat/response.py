"""`/v1/chat/completions` response models: the whole completion and the stream's chunks."""

from __future__ import annotations

from typing import Any, Literal

from serve_app.schema.common import ResponseModel, Usage


class FunctionCall(ResponseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(ResponseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(ResponseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class TopLogprobEntry(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(ResponseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(ResponseModel):
    content: list[LogprobEntry]


class Choice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM shape
    prefill_time: float | None = None  # ms to the first token (MindIE)
    decode_time_arr: list[float] | None = None  # ms per later token (MindIE)


class DeltaFunctionCall(ResponseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(ResponseModel):
    """OpenAI's streamed call: the first delta of a call has index, id, type and name;
    later ones with the same index append to `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class Delta(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChunkChoice(ResponseModel):
    index: int
    delta: Delta
    logprobs: ChoiceLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    full_text: str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None

