"""Reading a request body: bounded in bytes, strict JSON, bounded in nesting, then
validated against its dialect's request model.

Every check before `parse_request` runs before pydantic sees the data, so nothing
downstream (validation, JSON-schema checks, grammars, templates, Ray's pickling) meets a
body that could exhaust memory or Python's recursion limit.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from serve_app.http.errors import APIError, invalid_unicode, validation_error

Model = TypeVar("Model", bound=BaseModel)

# Deep enough for any real request (a tool schema nested twenty levels sits near depth
# 30); shallow enough that recursive code downstream never nears Python's limit of 1000.
MAX_JSON_DEPTH = 64


async def read_json_body(request: Request, limit: int) -> dict:
    """The body as a JSON object, or an APIError: 413 over `limit` bytes (known from
    Content-Length before reading, else as soon as the stream passes it), 400 otherwise."""
    return parse_json_object(await _read_bounded(request, limit))


async def _read_bounded(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else "larger than that"
    return APIError(413, f"request body is {got}; the limit is {limit} bytes", code="request_too_large")


def parse_json_object(body: bytes) -> dict:
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, _NonFiniteNumber) as exc:
        raise invalid_json(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise _too_deep() from None
    if not isinstance(data, dict):
        raise invalid_json("request body must be a JSON object")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise _too_deep()
    return data


def invalid_json(message: str) -> APIError:
    return APIError(400, message, code="invalid_json")


class _NonFiniteNumber(ValueError):
    pass


def _refuse_constant(name: str) -> Any:
    # Python's json module accepts NaN and Infinity; JSON (RFC 8259) does not.
    raise _NonFiniteNumber(f"{name} is not a JSON number")


def _too_deep() -> APIError:
    return invalid_json(f"request body is nested too deeply (the limit is {MAX_JSON_DEPTH} levels)")


def json_depth(value: Any) -> int:
    """Nesting depth of parsed JSON (a scalar is 0), walked without recursion; stops
    early once past MAX_JSON_DEPTH."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        depth += 1
        if depth > MAX_JSON_DEPTH:
            return depth
        deepest = max(deepest, depth)
        stack.extend((child, depth) for child in children if isinstance(child, (dict, list)))
    return deepest


def parse_request(model_cls: type[Model], data: dict) -> Model:
    """The request model of a parsed body (HTTP or the handle API), every rule of the
    dialect checked, or a 400 APIError naming the field."""
    if (error := invalid_unicode(data)) is not None:
        raise error
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc) from None
