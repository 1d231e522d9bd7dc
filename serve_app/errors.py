"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a status code."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from workers.protocol import ErrorInfo

# pydantic puts union member names into error locations; they are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "function-after", "function-before", "literal_error"}


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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    @classmethod
    def from_info(cls, info: ErrorInfo) -> "APIError":
        return cls(info.status, info.message, info.type, info.param, info.code)


def validation_error(exc: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming the field (vLLM maps these to 400, not 422)."""
    err = exc.errors()[0]
    parts = [str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p))]
    param = ".".join(parts) or None
    message = err["msg"] if param is None else f"{param}: {err['msg']}"
    return APIError(400, message, param=param)


def not_found_model(model: str, served: list[str]) -> APIError:
    return APIError(
        404, f"The model `{model}` does not exist. Served models: {served}", param="model", code="model_not_found"
    )
