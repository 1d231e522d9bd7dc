"""The worker's one error type: a request refused or failed on the worker, with what its
client is told (HTTP status, error type, code, the field at fault). Each kind of failure
is a subclass that fixes those; `info()` is the `ErrorInfo` a worker sends, which the
ingress maps to HTTP in one place (serve_app/http/errors.py)."""

from __future__ import annotations

from workers.contract.chunks import ErrorInfo


class WorkerError(Exception):
    status: int = 400
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    prefix: str = ""  # what the client's message says before this error's own text

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code

    def info(self, param: str | None = None) -> ErrorInfo:
        """The error as a worker sends it; `param` names the field at fault when the
        raiser could not (it did not see the request)."""
        return ErrorInfo(self.status, self.prefix + str(self), self.type, param or self.param, self.code)
