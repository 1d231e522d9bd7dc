"""`response_format` → the engine's output constraint, for every route that takes it.

- `{"type": "text"}` or absent: no constraint.
- `{"type": "json_object"}`: the content is one JSON object (any keys).
- `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}`:
  the content is JSON that validates against `schema`, whatever `strict` says.

The schema is checked here with llguidance (no tokenizer needed), so a schema the
engine cannot enforce is a 400 naming `response_format` before any worker sees it.
"""

from __future__ import annotations

import json

from serve_app.errors import APIError
from serve_app.protocol import JSONObjectFormat, JSONSchemaFormat, TextFormat
from workers.guided import grammar_error
from workers.sampling_params import GuidedDecoding

JSON_OBJECT_SCHEMA = {"type": "object"}


def guided_decoding(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None) -> GuidedDecoding | None:
    if fmt is None or isinstance(fmt, TextFormat):
        return None
    schema = fmt.json_schema.schema_ if isinstance(fmt, JSONSchemaFormat) else JSON_OBJECT_SCHEMA
    guided = GuidedDecoding(kind="json_schema", spec=json.dumps(schema), param="response_format")
    error = grammar_error(guided)
    if error is not None:
        raise APIError(400, f"response_format: this JSON schema cannot be enforced: {error}",
                       param="response_format", code="invalid_schema")
    return guided
