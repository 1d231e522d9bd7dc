"""`response_format`: its request models, and the engine's output constraint it becomes
(every route that takes it).

- `{"type": "text"}` or absent: no constraint.
- `{"type": "json_object"}`: the content is one JSON object (any keys).
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`:
  the content is JSON that validates against `schema`, whatever `strict` says.
- `{"type": "structural_tag", "structures": [...], "triggers": [...]}` (vLLM's): free text
  whose tagged segments hold JSON of their schema (serve_app/schema/structural_tag.py).

The schema is checked here with llguidance (no tokenizer needed), so a schema the
engine cannot enforce is a 400 naming `response_format` before any worker sees it.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WrapValidator
from pydantic_core import PydanticCustomError

from serve_app.http.errors import APIError
from serve_app.schema.structural_tag import StructuralTag, structural_tag_grammar
from workers.contract.grammar import grammar_error
from workers.contract.sampling_params import GuidedDecoding

JSON_OBJECT_SCHEMA = {"type": "object"}


def guided_decoding(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | StructuralTag | None,
                    ) -> GuidedDecoding | None:
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    if isinstance(fmt, StructuralTag):
        guided = GuidedDecoding(kind="lark", spec=structural_tag_grammar("response_format", fmt),
                                param="response_format")
        if (error := grammar_error(guided)) is not None:
            raise APIError(400, f"response_format: this structural tag cannot be enforced: {error}",
                           param="response_format", code="invalid_schema")
        return guided
    schema = fmt.json_schema.schema_ if isinstance(fmt, JSONSchemaFormat) else JSON_OBJECT_SCHEMA
    guided = GuidedDecoding(kind="json_schema", spec=json.dumps(schema), param="response_format")
    error = grammar_error(guided)
    if error is not None:
        raise APIError(400, f"response_format: this JSON schema cannot be enforced: {error}",
                       param="response_format", code="invalid_schema")
    return guided


class _FormatModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as every request model


class TextFormat(_FormatModel):
    type: Literal["text"]


class JSONObjectFormat(_FormatModel):
    type: Literal["json_object"]


class JSONSchemaSpec(_FormatModel):
    # `schema` would shadow a BaseModel attribute: the field is `schema_`, read from
    # either name (so a dumped request validates again).
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(min_length=1)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the schema is always enforced, strict or not


class JSONSchemaFormat(_FormatModel):
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


# OpenAI's structured output; what each means is in the module docstring.
ResponseFormat = Annotated[
    Annotated[TextFormat | JSONObjectFormat | JSONSchemaFormat | StructuralTag, Field(discriminator="type")] | None,
    WrapValidator(_as_one_param),
]

