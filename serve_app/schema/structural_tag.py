"""vLLM's structural tags: free text in which each `begin` ... `end` segment the model opens
(once it writes one of the `triggers`) must hold JSON matching that structure's schema, the
way tool calls are embedded in an answer (`<function=get_weather>{...}</function>`).

    {"type": "structural_tag", "triggers": ["<function="],
     "structures": [{"begin": "<function=get_weather>", "schema": {...}, "end": "</function>"}]}

Taken as `response_format` and as `structured_outputs.structural_tag` (that object, or its
JSON text). It becomes a Lark grammar by llguidance's StructTag (the text between segments
is free; a trigger is matched as text, never assumed to be a special token)."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from llguidance import StructTag
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from serve_app.http.errors import APIError


class TagStructure(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    begin: str = Field(min_length=1)
    schema_: dict[str, Any] = Field(alias="schema")
    end: str = ""

    @field_validator("schema_")
    @classmethod
    def _valid_json_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        try:
            jsonschema.Draft202012Validator.check_schema(schema)
        except jsonschema.SchemaError as exc:
            raise ValueError(f"not a valid JSON schema: {exc.message}") from None
        return schema


class StructuralTag(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["structural_tag"] = "structural_tag"
    structures: list[TagStructure] = Field(min_length=1)
    triggers: list[str] = Field(min_length=1)

    @field_validator("triggers")
    @classmethod
    def _non_empty(cls, triggers: list[str]) -> list[str]:
        if any(not t for t in triggers):
            raise ValueError("triggers must be non-empty strings")
        return triggers


def parse_structural_tag(field: str, value: Any) -> StructuralTag:
    """The tag of a request field (an object or its JSON text); a 400 naming the field."""
    try:
        if isinstance(value, str):
            value = json.loads(value)
        return value if isinstance(value, StructuralTag) else StructuralTag.model_validate(value)
    except (json.JSONDecodeError, ValidationError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else _first_error(exc)
        raise APIError(400, f"{field}: not a structural tag: {detail}", param=field) from None


def structural_tag_grammar(field: str, tag: StructuralTag) -> str:
    """The Lark grammar of a structural tag: each structure starts at the trigger its
    `begin` starts with (none: a 400 naming the structure)."""
    tags = []
    for i, structure in enumerate(tag.structures):
        trigger = next((t for t in tag.triggers if structure.begin.startswith(t)), None)
        if trigger is None:
            raise APIError(400, f"{field}: structures.{i}.begin {structure.begin[:64]!r} starts with none of the "
                           f"triggers {tag.triggers}", param=field)
        tags.append(StructTag(trigger=trigger, begin=structure.begin, grammar=structure.schema_, end=structure.end))
    return StructTag.to_grammar(tags, assume_special=False)


def _first_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]
