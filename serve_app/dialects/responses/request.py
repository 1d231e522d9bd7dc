"""`/v1/responses` request models: input items, function tools, `text.format`, and the rules between fields.

Every problem is a 400 naming the field as the client wrote it (`input.2.call_id`,
`tools.0.type`, `text.format.schema`): one wrap validator rewrites pydantic's error
location, which also lists union members and item tags, into the path through the body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    field_validator,
    model_validator,
)

from serve_app.http.errors import APIError, field_rule, unsupported
from serve_app.schema.body_paths import BodyPathErrors
from serve_app.schema.common import RequestModel
from serve_app.schema.structured_outputs import StructuredOutputFields
from serve_app.schema.tools import FunctionDefinition

# ------------------------------------------------------------------------ content parts


class InputText(RequestModel):
    type: Literal["input_text"]
    text: str


class OutputText(RequestModel):
    """An earlier answer's text, sent back as input (its annotations and logprobs are ignored)."""

    type: Literal["output_text"]
    text: str


class Refusal(RequestModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(RequestModel):
    type: Literal["input_image"]
    image_url: str | None = None  # an http(s) URL or a data: URI
    file_id: str | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None

    @model_validator(mode="after")
    def _needs_url(self) -> InputImage:
        if self.file_id is not None:
            raise field_rule(unsupported("file_id", "is not supported: this server has no Files API; "
                                         "send the image as image_url (a URL or a data: URI)"))
        if not self.image_url:
            raise field_rule(APIError(400, "an input_image needs image_url", param="image_url"))
        return self


def _type_tag(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputText, Tag("output_text")]
    | Annotated[Refusal, Tag("refusal")] | Annotated[InputImage, Tag("input_image")],
    Discriminator(_type_tag, custom_error_type="unsupported_part",
                  custom_error_message="content parts must be input_text, output_text, refusal or input_image "
                                       "(files and audio are not supported)"),
]


def _text_as_parts(value: Any) -> Any:
    """A content string is one text part."""
    return [{"type": "input_text", "text": value}] if isinstance(value, str) else value


# --------------------------------------------------------------------------- input items


class MessageItem(RequestModel):
    """`{"role", "content"}`, with or without `"type": "message"`; an earlier answer's
    message (its id and status) is accepted too."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Annotated[list[ContentPart], BeforeValidator(_text_as_parts)]


class FunctionCallItem(RequestModel):
    """A call the model made earlier (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str  # JSON text, as the model wrote it


def _output_text(value: Any) -> Any:
    """A tool's output: a string, or text parts (joined)."""
    if not isinstance(value, list):
        return value
    texts = []
    for part in value:
        if not (isinstance(part, dict) and part.get("type") in ("input_text", "output_text")
                and isinstance(part.get("text"), str)):
            raise ValueError("a function_call_output's output must be a string or a list of input_text parts")
        texts.append(part["text"])
    return "".join(texts)


class FunctionCallOutputItem(RequestModel):
    """What the client's function returned for a call."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Annotated[str, BeforeValidator(_output_text)]


class ReasoningItem(RequestModel):
    """An earlier answer's reasoning, sent back as input: accepted and left out of the
    prompt (chat templates drop earlier turns' reasoning too)."""

    type: Literal["reasoning"]


def _item_tag(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_tag, custom_error_type="unsupported_item",
                  custom_error_message="input items must be messages, function_call, function_call_output or "
                                       "reasoning items (item_reference and built-in tools' items are not supported)"),
]


def _string_as_message(value: Any) -> Any:
    """`input` as a string is one user message."""
    return [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else value


# ------------------------------------------------------------------------------- tools


class FunctionTool(FunctionDefinition):
    """The Responses API's flat function tool; the name and parameters follow the chat rules."""

    type: Literal["function"]


def _function_tools_only(tools: Any) -> Any:
    """Built-in tools (web_search, file_search, ...) are OpenAI's own: a 400 naming the item's type."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") != "function":
            raise field_rule(APIError(400, f"tool type {str(tool.get('type'))[:40]!r} is not supported: only "
                                      "function tools are (built-in tools are OpenAI's own)",
                                      param=f"{i}.type", code="unsupported_tool"))
    return tools


class FunctionToolChoice(RequestModel):
    type: Literal["function"]
    name: str


def _function_choice_only(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") != "function":
        raise ValueError(f"tool_choice objects must name a function ({{\"type\": \"function\", \"name\": ...}}); "
                         f"{str(choice.get('type'))[:40]!r} is not supported")
    return choice


ToolChoice = Annotated[Literal["none", "auto", "required"] | FunctionToolChoice, BeforeValidator(_function_choice_only)]


# --------------------------------------------------------------------------- text.format


class TextFormatText(RequestModel):
    type: Literal["text"]


class TextFormatJSONObject(RequestModel):
    type: Literal["json_object"]


class TextFormatJSONSchema(RequestModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # the schema is always enforced, strict or not


TextFormat = Annotated[TextFormatText | TextFormatJSONObject | TextFormatJSONSchema, Field(discriminator="type")]


class TextConfig(RequestModel):
    format: TextFormat = TextFormatText(type="text")


# ------------------------------------------------------------------------------ request

MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


class ResponsesRequest(BodyPathErrors, StructuredOutputFields, RequestModel):
    """OpenAI's Responses request; vLLM's `structured_outputs` / `guided_*` fields too
    (serve_app/schema/structured_outputs.py), as on chat."""

    model: str
    input: Annotated[list[InputItem], BeforeValidator(_string_as_message)]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False

    tools: Annotated[list[FunctionTool] | None, BeforeValidator(_function_tools_only)] = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: bool = True
    text: TextConfig | None = None

    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)  # None: 1.0
    seed: int | None = Field(None, ge=0, le=2**63 - 1)  # not OpenAI's; vLLM's
    user: str | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        if metadata is not None:
            if len(metadata) > MAX_METADATA_KEYS:
                raise ValueError(f"at most {MAX_METADATA_KEYS} keys are allowed, got {len(metadata)}")
            for key, value in metadata.items():
                if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                    raise ValueError(f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                                     f"{MAX_METADATA_VALUE}; {key[:64]!r} is longer")
        return metadata

    @model_validator(mode="after")
    def _rules_between_fields(self) -> ResponsesRequest:
        if (error := self._unsupported() or self._tool_error()) is not None:
            raise field_rule(error)
        return self

    def _unsupported(self) -> APIError | None:
        if self.truncation == "auto":
            return unsupported("truncation", "\"auto\" is not supported: an input longer than the context window "
                               "is a 400 (use \"disabled\")")
        if self.background:
            return unsupported("background", "is not supported: responses are answered while the request waits")
        if self.conversation is not None:
            return unsupported("conversation", "is not supported: use previous_response_id, or send the history "
                               "in `input`")
        if self.prompt is not None:
            return unsupported("prompt", "is not supported: this server has no stored prompt templates")
        if self.previous_response_id is not None and not self.previous_response_id.startswith("resp_"):
            return APIError(400, f"previous_response_id must be a response id (resp_...), got "
                            f"{self.previous_response_id[:64]!r}", param="previous_response_id")
        return None

    def _tool_error(self) -> APIError | None:
        names = [t.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return APIError(400, "function names in tools must be unique", param="tools")
        choice = self.tool_choice
        if choice is not None and choice != "none" and not names:
            return APIError(400, "tool_choice needs tools", param="tool_choice")
        if isinstance(choice, FunctionToolChoice) and choice.name not in names:
            return APIError(400, f"tool_choice names {choice.name!r}, which is not among the tools {names}",
                            param="tool_choice")
        return None
