"""Tool definitions (`tools`, `tool_choice`) as requests carry them, and what the output
parsers read of a request's tools; shared by the chat and Responses dialects, /tokenize
and the tool-call parsers (serve_app/output/tool_parsers.py)."""

from __future__ import annotations

from typing import Any, Literal, Protocol

import jsonschema
from pydantic import Field, field_validator

from serve_app.schema.common import RequestModel

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


class ToolUse(Protocol):
    """What the output parsers read of a request (a chat request, or the one a Responses
    request becomes): the tools the model may call, and whether the grammar forces calls."""

    @property
    def tools_in_play(self) -> list[Tool]: ...

    @property
    def forced_tool_calls(self) -> bool: ...
