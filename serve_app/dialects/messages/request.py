"""`/v1/messages` (Anthropic's Messages API) request models: content blocks, custom tools,
`tool_choice`, `thinking`, `output_config.format`, and the rules between fields.

Every problem is a 400 naming the field as the client wrote it (`messages.1.content.0.source`),
as on /v1/responses (serve_app/schema/body_paths.py). Fields about Anthropic's own service
(`cache_control`, `service_tier`, `container` hints, `inference_geo`, `speed`,
`output_config.effort`) are accepted and have no effect; what would change the answer and
this server cannot do (server tools, documents, MCP servers) is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    model_validator,
)

from serve_app.http.errors import APIError, field_rule, unsupported
from serve_app.schema.body_paths import BodyPathErrors
from serve_app.schema.common import RequestModel, StopStrings
from serve_app.schema.structured_outputs import StructuredOutputFields

# --------------------------------------------------------------------------- content blocks


class TextBlock(RequestModel):
    type: Literal["text"]
    text: str


class Base64Source(RequestModel):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str


class URLSource(RequestModel):
    type: Literal["url"]
    url: str


class ImageBlock(RequestModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]

    @property
    def url(self) -> str:
        """The image as the chat path's `image_url` (a data URL for base64 data)."""
        source = self.source
        return source.url if isinstance(source, URLSource) else f"data:{source.media_type};base64,{source.data}"


class ToolUseBlock(RequestModel):
    """A call the assistant made earlier in the conversation."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict[str, Any]


ToolResultContent = Annotated[TextBlock | ImageBlock, Field(discriminator="type")]


class ToolResultBlock(RequestModel):
    """What a call returned, in the user turn after it."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[ToolResultContent] = ""
    is_error: bool = False


class ThinkingBlock(RequestModel):
    """An earlier answer's reasoning, sent back: accepted and left out of the prompt (chat
    templates drop earlier turns' reasoning too)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(RequestModel):
    type: Literal["redacted_thinking"]
    data: str


def _block_tag(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")],
    Discriminator(_block_tag, custom_error_type="unsupported_part",
                  custom_error_message="content blocks must be text, image, tool_use, tool_result, thinking or "
                                       "redacted_thinking (documents, search results and server tools' blocks are "
                                       "not supported)"),
]

# Which role may send which block.
_ROLE_BLOCKS = {"user": {"text", "image", "tool_result"},
                "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}


class Message(RequestModel):
    role: Literal["user", "assistant"]
    content: list[ContentBlock] | str  # the list first: its errors name the block

    @property
    def blocks(self) -> list[Any]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else self.content


# ------------------------------------------------------------------------------ tools


class CustomTool(RequestModel):
    """A client tool: the model writes its `input`, the client runs it. The name and schema
    follow the chat path's rules (they become a function tool there)."""

    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None


def _custom_tools_only(tools: Any) -> Any:
    """Server tools (web search, code execution, bash, text editor, ...) run on Anthropic's
    side: a 400 naming the tool's type."""
    for i, tool in enumerate(tools if isinstance(tools, list) else []):
        if isinstance(tool, dict) and tool.get("type") not in (None, "custom"):
            raise field_rule(APIError(400, f"tool type {str(tool.get('type'))[:40]!r} is not supported: only "
                                      "custom tools (name, description, input_schema) are; server tools run on "
                                      "Anthropic's side", param=f"{i}.type", code="unsupported_tool"))
    return tools


class ToolChoiceAuto(RequestModel):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(RequestModel):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(RequestModel):
    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(RequestModel):
    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


# ---------------------------------------------------------------------- thinking, output


class ThinkingEnabled(RequestModel):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1024)


class ThinkingAdaptive(RequestModel):
    type: Literal["adaptive"]


class ThinkingDisabled(RequestModel):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class JSONSchemaFormat(RequestModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(RequestModel):
    format: JSONSchemaFormat | None = None
    effort: str | None = None  # a hint to Anthropic's models; no effect here


class Metadata(RequestModel):
    user_id: str | None = Field(None, max_length=256)


# ------------------------------------------------------------------------------ request


class MessagesRequest(BodyPathErrors, StructuredOutputFields, RequestModel):
    """Anthropic's Messages request; vLLM's `structured_outputs` / `guided_*` fields too
    (serve_app/schema/structured_outputs.py), as on chat."""

    model: str
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: StopStrings = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0)  # 0: off
    metadata: Metadata | None = None
    tools: Annotated[list[CustomTool] | None, BeforeValidator(_custom_tools_only)] = None
    tool_choice: ToolChoice | None = None  # None: auto
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    mcp_servers: list[Any] | None = None

    @model_validator(mode="after")
    def _rules_between_fields(self) -> MessagesRequest:
        if (error := self._unsupported() or self._conversation_error() or self._tool_error()
                or self._thinking_error()) is not None:
            raise field_rule(error)
        return self

    def _unsupported(self) -> APIError | None:
        if self.mcp_servers:
            return unsupported("mcp_servers", "is not supported: this server calls no tools itself")
        return None

    def _conversation_error(self) -> APIError | None:
        """Blocks sent by the role that may send them; each tool_result answers a tool_use
        of an earlier assistant turn."""
        called: set[str] = set()
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.blocks):
                if block.type not in _ROLE_BLOCKS[message.role]:
                    param = f"messages.{i}.content.{j}.type"
                    return APIError(400, f"{param}: a {block.type} block cannot be in an {message.role} turn "
                                    f"(it takes {sorted(_ROLE_BLOCKS[message.role])})", param=param)
                if isinstance(block, ToolUseBlock):
                    called.add(block.id)
                elif isinstance(block, ToolResultBlock) and block.tool_use_id not in called:
                    return APIError(400, f"messages.{i}.content.{j}.tool_use_id: {block.tool_use_id[:64]!r} "
                                    "answers no tool_use block of an earlier assistant message",
                                    param=f"messages.{i}.content.{j}.tool_use_id")
        return None

    def _tool_error(self) -> APIError | None:
        names = [t.name for t in self.tools or []]
        if len(set(names)) < len(names):
            return APIError(400, "tools: tool names must be unique", param="tools")
        choice = self.tool_choice
        if choice is not None and choice.type != "none" and not names:
            return APIError(400, "tool_choice: tool_choice needs tools", param="tool_choice")
        if isinstance(choice, ToolChoiceTool) and choice.name not in names:
            return APIError(400, f"tool_choice.name: {choice.name!r} is not among the tools {names}",
                            param="tool_choice.name")
        return None

    def _thinking_error(self) -> APIError | None:
        thinking = self.thinking
        if isinstance(thinking, ThinkingEnabled) and self.max_tokens and thinking.budget_tokens >= self.max_tokens:
            return APIError(400, f"thinking.budget_tokens: must be less than max_tokens ({self.max_tokens})",
                            param="thinking.budget_tokens")
        return None

    @property
    def forced_tool_call(self) -> bool:
        return isinstance(self.tool_choice, (ToolChoiceAny, ToolChoiceTool))

    @property
    def ends_with_assistant(self) -> bool:
        """The last turn is the assistant's: the answer continues it (Anthropic's prefill)."""
        return self.messages[-1].role == "assistant"


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a Messages request without its output cap."""

    max_tokens: int | None = Field(None, ge=1)
