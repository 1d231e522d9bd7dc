"""vLLM's structured-output request fields and the engine constraint each becomes, beside
OpenAI's `response_format` (serve_app/schema/response_format.py):

- `structured_outputs: {json | regex | choice | grammar | json_object | structural_tag}`: exactly one of
  `json` (a JSON schema, as an object or its JSON text), `regex` (the whole output
  matches it; llguidance's regex syntax, Rust's), `choice` (the output is one of these
  strings), `grammar` (a Lark grammar in llguidance's dialect, `start` its top rule) or
  `json_object: true` (any JSON object) or `structural_tag` (tagged JSON segments in free
  text, serve_app/schema/structural_tag.py).
- The older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` fields, one
  of them, mean the same.

One constraint a request: two of these, or one with a non-text `response_format`, is a 400
naming the field. Each is checked with llguidance here (no tokenizer needed), so one the
engine cannot enforce is a 400 naming its field before a worker sees it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from serve_app.http.errors import APIError
from serve_app.schema.structural_tag import parse_structural_tag, structural_tag_grammar
from workers.contract.grammar import grammar_error
from workers.contract.sampling_params import GuidedDecoding

LEGACY_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(extra="ignore")  # as every request model (vLLM's other knobs: ignored)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None  # serve_app/schema/structural_tag.py

    def given(self) -> dict[str, Any]:
        """The constraint fields set, by name (json_object only when true)."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return {name: value for name, value in values.items() if value is not None}


class StructuredOutputFields(BaseModel):
    """The request fields, mixed into the routes' shared sampling fields."""

    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None

    def structured_output(self) -> tuple[str, str, Any] | None:
        """(request field, kind, value) of the one constraint asked for, None for none; a
        400 naming the field when there are two."""
        given = self.structured_outputs.given() if self.structured_outputs is not None else {}
        asked = [(f"structured_outputs.{kind}", kind, value) for kind, value in given.items()]
        asked += [(name, name.removeprefix("guided_"), getattr(self, name)) for name in LEGACY_FIELDS
                  if getattr(self, name) is not None]
        if len(asked) > 1:
            fields = ", ".join(field for field, _, _ in asked)
            raise APIError(400, f"one structured output a request; this one asks for {fields}", param=asked[1][0])
        return asked[0] if asked else None


    def structured_fields(self) -> dict[str, Any]:
        """The fields as sent, for a chat request made from another dialect's (Responses,
        Messages), whose rules then apply: one constraint, none beside a JSON format or a forced call."""
        fields = {name: getattr(self, name) for name in ("structured_outputs", *LEGACY_FIELDS)}
        if fields["structured_outputs"] is not None:
            fields["structured_outputs"] = fields["structured_outputs"].model_dump(by_alias=True, exclude_none=True)
        return {name: value for name, value in fields.items() if value is not None}


def structured_guided(fields: StructuredOutputFields) -> GuidedDecoding | None:
    """The engine constraint of the request's structured-output fields, checked."""
    asked = fields.structured_output()
    if asked is None:
        return None
    field, kind, value = asked
    guided = GuidedDecoding(*_constraint(field, kind, value), param=field)
    error = grammar_error(guided)
    if error is not None:
        raise APIError(400, f"{field}: this constraint cannot be enforced: {error}", param=field,
                       code="invalid_grammar")
    return guided


def _constraint(field: str, kind: str, value: Any) -> tuple[str, str]:
    """(GuidedDecoding kind, spec) of one field's value."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise APIError(400, f"{field}: not JSON: {exc}", param=field) from None
        return "json_schema", json.dumps(value)
    if kind == "json_object":
        return "json_schema", json.dumps({"type": "object"})
    if kind == "regex":
        return "regex", value
    if kind == "structural_tag":
        return "lark", structural_tag_grammar(field, parse_structural_tag(field, value))
    if kind == "choice":
        # A Lark alternation of string literals: JSON's escapes are Lark's, so any text is exact.
        return "lark", "start: " + " | ".join(json.dumps(option) for option in value)
    return "lark", value  # grammar
