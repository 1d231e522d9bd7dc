"""A request's first validation error as a 400 naming the path through the body the client
sent (`messages.2.content.0.source`, `input.1.call_id`): pydantic's error location also
lists union members and tags, which are not in the body. Used by the dialects whose
requests are nested unions of typed items (Responses, Messages)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError, model_validator

from serve_app.http.errors import APIError, field_rule

# pydantic's error types for a tag that names no member of a tagged union.
_BAD_TAGS = {"unsupported_part", "unsupported_item", "union_tag_invalid", "union_tag_not_found"}


def body_path_error(exc: ValidationError, data: Any) -> APIError:
    """The first error as a 400 whose param is the path through the request body: pydantic's
    location parts that index into the body are kept, the names of union members and tags
    (which are not in the body) dropped; a missing field is named."""
    err = exc.errors()[0]
    loc = list(err["loc"])
    path, node = [], data
    for i, part in enumerate(loc):
        if _indexes(node, part):
            path.append(str(part))
            node = node[part]
        elif i == len(loc) - 1 and isinstance(node, dict) and err["type"] == "missing":
            path.append(str(part))
    if err["type"] in _BAD_TAGS and isinstance(node, dict):
        path.append("type")
    ctx = err.get("ctx") or {}
    if err["type"] != "field_rule":
        param = ".".join(path) or None
        return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param)
    # A rule between fields: its param is relative to the model that raised it (the
    # request itself when the path is empty, whose messages need no prefix).
    param = ".".join(path + ([ctx["param"]] if ctx.get("param") else [])) or None
    message = f"{param}: {ctx['message']}" if path else ctx["message"]
    return APIError(400, message, param=param, code=ctx.get("code"))


def _indexes(node: Any, part: str | int) -> bool:
    """Whether a location part is a key or an index of the body at `node`."""
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


class BodyPathErrors(BaseModel):
    """A request model whose first validation error names its path through the body."""

    @model_validator(mode="wrap")
    @classmethod
    def _errors_name_body_paths(cls, data: Any, handler) -> Any:
        try:
            return handler(data)
        except ValidationError as exc:
            raise field_rule(body_path_error(exc, data)) from None
