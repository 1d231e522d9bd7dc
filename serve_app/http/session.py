"""The session key of the HTTP request being handled: the `x-session-id` header, else the
body's `user`. The worker router keeps a session on one replica (serve_app/transport/
prefix_routing.py). A context variable, because the key is read where the worker call is
made, not where the request was parsed."""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

SESSION_HEADER = "x-session-id"

_session_key: contextvars.ContextVar[str | None] = contextvars.ContextVar("session_key", default=None)


def remember_session(headers: Mapping[str, str], request: Any) -> None:
    _session_key.set(headers.get(SESSION_HEADER) or getattr(request, "user", None))


def current_session() -> str | None:
    return _session_key.get()
