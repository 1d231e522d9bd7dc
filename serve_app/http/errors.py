"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a status code."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError
from starlette.responses import JSONResponse

from serve_app.http.unicode_text import lone_surrogate_path
from workers.contract.chunks import ErrorInfo

# pydantic puts union member names into error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "literal_error"}

# The pydantic error type of a rule between fields (see field_rule).
_FIELD_RULE = "field_rule"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def __reduce__(self):
        # Rebuild from every field, so the error crosses Ray handles (other apps catch it).
        return (type(self), (self.status, self.message, self.type, self.param, self.code, self.headers))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, body: dict | None = None) -> JSONResponse:
        """The error as a JSON response: OpenAI's shape, or `body` (a dialect's own shape)."""
        return _ASCIIJSONResponse(self.body() if body is None else body, status_code=self.status,
                                  headers=self.headers)

    @classmethod
    def from_info(cls, info: ErrorInfo, param_names: Mapping[str, str] | None = None) -> "APIError":
        """A worker's error; `param_names` renames the worker's field names (those of
        /v1/chat/completions) to the route's own, e.g. `max_tokens` -> `max_completion_tokens`."""
        param = info.param if param_names is None else param_names.get(info.param, info.param)
        return cls(info.status, info.message, info.type, param, info.code)


class _ASCIIJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message may quote client text, and a lone surrogate
    in it is a valid JSON escape but cannot be encoded as UTF-8 (Starlette's default)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def invalid_unicode(data: Any) -> APIError | None:
    """A 400 naming the first field whose text holds a lone UTF-16 surrogate (not Unicode:
    the tokenizer fails on it), or None."""
    path = lone_surrogate_path(data)
    if path is None:
        return None
    return APIError(400, f"{path or 'body'}: text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                    "escape), which is not valid Unicode", param=path or None, code="invalid_unicode")


def field_rule(error: APIError) -> PydanticCustomError:
    """A broken rule between fields, raised by a model validator. pydantic puts such errors
    at location `()`, so the param (and code, message) ride in the context, where
    validation_error finds them."""
    # `message` last: pydantic substitutes the context into the template in order, and a
    # message quoting client text may hold "{param}" or "{code}".
    return PydanticCustomError(_FIELD_RULE, "{message}",
                               {"param": error.param, "code": error.code, "message": error.message})


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (vLLM maps these to 400, not 422)."""
    err = exc.errors()[0]
    if err["type"] == _FIELD_RULE:
        ctx = err["ctx"]
        return APIError(400, ctx["message"], param=ctx["param"], code=ctx["code"])
    parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    param = ".".join(parts) or None
    message = err["msg"] if param is None else f"{param}: {err['msg']}"
    return APIError(400, message, param=param)


def unsupported(field: str, detail: str = "is not supported by this server yet") -> APIError:
    """A known field set to a value this server does not honour: 400, never a silently different answer."""
    return APIError(400, f"`{field}` {detail}", param=field, code="unsupported_parameter")


def unauthorized(message: str) -> APIError:
    """401 in OpenAI's shape; the message must never contain the presented key."""
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def not_found_model(model: str, served: list[str]) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist. Served models: {served}", param="model", code="model_not_found"
    )


@contextmanager
def params_renamed(rename: Callable[[str], str]) -> Iterator[None]:
    """Errors raised inside name their field by `rename`: a dialect translated into the chat
    request (Responses, Messages) names its own fields, not the chat request's."""
    try:
        yield
    except APIError as exc:
        if exc.param is not None and (param := rename(exc.param)) != exc.param:
            old = exc.param
            exc.message = f"{param}{exc.message[len(old):]}" if exc.message.startswith(old) else exc.message
            exc.param = param
        raise
