"""OpenAI chat-completion request and response models.

Unknown request fields are ignored (as vLLM does), so clients written for other
servers keep working; every field this server knows is honoured. Response models mark every always-present field as required and every extra
(stop_reason, prefill_time, ...) optional: they are dumped with `exclude_unset`, so an
extra appears only when the server set it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError


class RequestModel(BaseModel):
    """Base of every request model of every route: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


def or_default(value, default):
    """JSON null and an absent field both mean the documented default."""
    return default if value is None else value


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageURL(RequestModel):
    url: str
    detail: str | None = None


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: str | ImageURL  # seed 001 passes a bare string (a local path)


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class FunctionCallIn(RequestModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCallIn(RequestModel):
    """A call the assistant made earlier in the conversation (seed 001, request sample 2)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # name, ... reach the chat template
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _tool_fields_match_role(self) -> "ChatMessage":
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self


# ------------------------------------------------------------------------------- tools

_FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function names


class FunctionDefinition(RequestModel):
    name: str = Field(pattern=_FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _valid_json_schema(cls, schema: dict[str, Any] | None) -> dict[str, Any] | None:
        if schema is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(schema)
            except jsonschema.SchemaError as exc:
                raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        return schema

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object", "properties": {}}


class Tool(RequestModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextFormat(RequestModel):
    type: Literal["text"]


class JSONObjectFormat(RequestModel):
    type: Literal["json_object"]


class JSONSchemaSpec(RequestModel):
    # `schema` would shadow a BaseModel attribute: the field is `schema_`, read from
    # either name (so a dumped request validates again).
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaSpec


def _as_one_param(value: Any, handler) -> Any:
    """Report any problem inside response_format as one error naming `response_format`."""
    try:
        return handler(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(p) for p in err["loc"]]
        if loc and isinstance(value, dict) and loc[0] == value.get("type"):
            loc = loc[1:]  # the union member's tag
        where = ".".join(loc)
        detail = f"{where}: {err['msg']}" if where else err["msg"]
        raise PydanticCustomError("response_format", "{detail}", {"detail": detail}) from None


# OpenAI's structured output; what each means is in serve_app/structured_output.py.
ResponseFormat = Annotated[
    Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat, Field(discriminator="type")] | None,
    WrapValidator(_as_one_param),
]


MAX_STOP_STRINGS = 256
MAX_LOGPROBS = 20


def _check_stops(stop: str | list[str] | None) -> str | list[str] | None:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    return stop


# The `stop` field of every route: a string or a list of non-empty strings, at most 256.
StopStrings = Annotated[str | list[str] | None, AfterValidator(_check_stops)]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


class ChatCompletionRequest(RequestModel):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)  # None: 1.0
    top_k: int | None = Field(None, ge=-1)  # None, 0 and -1: off
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopStrings = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    chat_template_kwargs: dict[str, Any] | None = None
    user: str | None = None

    use_beam_search: bool | None = False
    best_of: int | None = Field(None, ge=1, le=64)  # beam width
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0, allow_inf_nan=False)

    response_format: ResponseFormat = None

    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: true

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "ChatCompletionRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def cross_field_error(self) -> tuple[str, str] | None:
        """(param, message) for rules between fields that name one field, else None."""
        if (tool_rule := self._tool_error()) is not None:
            return tool_rule
        if self.use_beam_search:
            return beam_search_error(self)
        if self.best_of is not None:
            return "best_of", "best_of is only supported with use_beam_search"
        if self.length_penalty is not None and self.length_penalty != 1.0:
            return "length_penalty", "length_penalty needs use_beam_search: true"
        if self.n > 1 and (self.temperature == 0 or self.top_k == 1):
            return "n", "n > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) would give n identical choices"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        cap = self.output_cap
        if self.min_tokens and cap is not None and self.min_tokens > cap:
            return "min_tokens", f"min_tokens ({self.min_tokens}) is larger than max_tokens ({cap})"
        for key, bias in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit() or int(key) < 0:
                return "logit_bias", f"logit_bias keys must be token ids, got {key!r}"
            if not -100.0 <= bias <= 100.0:
                return "logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {key}"
        return None

    def _tool_error(self) -> tuple[str, str] | None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return "tools", "function names in tools must be unique"
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            return "tool_choice", "tool_choice needs tools"
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            return "tool_choice", f"tool_choice names {choice.function.name!r}, which is not among the tools {names}"
        if self.guided_tools and self.use_beam_search:
            return "tool_choice", "forced or strict tool calls are not available with beam search"
        if self.guided_tools and self.response_format is not None and self.response_format.type != "text":
            # One grammar a request: the calls' format or the answer's, not both.
            return "response_format", "response_format cannot be combined with forced or strict tool calls"
        return None

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def tools_in_play(self) -> list[Tool]:
        """The tools the model is shown and may call (none with tool_choice "none")."""
        return [] if self.effective_tool_choice == "none" else list(self.tools or [])

    @property
    def guided_tools(self) -> bool:
        """Whether the tool calls must be constrained by a grammar."""
        choice = self.effective_tool_choice
        return bool(self.tools_in_play) and (
            choice == "required" or isinstance(choice, NamedToolChoice)
            or any(t.function.strict for t in self.tools_in_play))

    @property
    def output_cap(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def stop_list(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)


def beam_search_error(req) -> tuple[str, str] | None:
    """(param, message) when a beam-search request breaks the MaaS rules (seed 003):
    n > 1, temperature 0, top_p 1, top_k -1 (or 0); no logprobs. Any route's request."""
    if req.n < 2:
        return "n", "beam search needs n > 1"
    if req.best_of is not None and req.best_of < req.n:
        return "best_of", f"best_of ({req.best_of}) must be at least n ({req.n})"
    if req.temperature not in (None, 0.0):
        return "temperature", "beam search needs temperature 0"
    if req.top_p not in (None, 1.0):
        return "top_p", "beam search needs top_p 1"
    if req.top_k not in (None, -1, 0):
        return "top_k", "beam search needs top_k -1"
    if req.logprobs is not None and req.logprobs is not False:  # completions' logprobs=0 asks too
        return "logprobs", "logprobs are not available with beam search"
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return "response_format", "structured output (response_format) is not available with beam search"
    return None


# ---------------------------------------------------------------------------- responses


class ResponseModel(BaseModel):
    """Dumped with exclude_unset: optional extras appear only when the server set them."""

    def dump(self) -> dict:
        return self.model_dump(exclude_unset=True)

    def dump_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # set for reasoning models
    prompt_tokens_details: PromptTokensDetails | None = None  # when the worker reports prefix-cache hits


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


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]
