"""What a request dialect supplies to the ingress's one generate path: a `Dialect` row.

Each dialect module (serve_app/dialects/) builds its row; serve_app/dialects/table.py lists
the rows, and the ingress serves one route per row, doing every step the same way for all
(serve_app/ingress.py `_generate`): API key and body (`request_model`: every rule of the
dialect at parse time), `model` resolved (a LoRA adapter attached), `plan`, then
`translate` to the worker's `GenerateRequest`, its token ids checked against the
vocabulary and its image parts fetched (inside `errors`), the session key, the worker call
(`param_names` renames the fields its errors name), and the chunks given to `output`: a
streamer (SSE events) or an accumulator (one JSON body).

A new dialect is one module that builds its row and one line in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from starlette.responses import Response

    from serve_app.config.app_config import ServerOptions
    from serve_app.http.errors import APIError
    from serve_app.transport.worker_call import Accumulator, Streamer
    from workers.contract.model_config import ModelConfig
    from workers.contract.requests import GenerateRequest

Req = TypeVar("Req")  # the dialect's request model
Plan = TypeVar("Plan")  # what `plan` makes of a request (the request itself by default)


@dataclass(frozen=True)
class CallContext:
    """What the ingress knows of a request besides its body, for a dialect's `plan` and `output`."""

    model: ModelConfig | None  # the served model's config (an adapter's base model)
    server: ServerOptions
    state: Any = None  # the dialect's own state on this ingress replica (`Dialect.state`), if any


def _the_request(req: Any, request_id: str, context: CallContext) -> Any:
    return req


@dataclass(frozen=True)
class Dialect(Generic[Req, Plan]):
    """One request dialect, as the generate path uses it."""

    path: str  # the route (POST)
    request_model: type[Req]
    new_id: Callable[[], str]  # the request id, which the answer's `id` carries
    # (plan, request id, served model's config) -> the worker's request; a 400 for what
    # only translation finds (e.g. a grammar llguidance cannot build).
    translate: Callable[[Plan, str, ModelConfig | None], GenerateRequest]
    # (plan, request id, context, stream) -> a streamer (`events`) or an accumulator (`add`, `result`).
    output: Callable[[Plan, str, CallContext, bool], Streamer | Accumulator]
    param_names: Mapping[str, str] | None = None  # the worker's field names -> the dialect's, in errors
    # What a request needs before translation (e.g. a stored conversation); may raise APIError.
    plan: Callable[[Req, str, CallContext], Plan] = _the_request
    # Around translation and the ingress's checks: how their errors name the dialect's fields.
    errors: Callable[[], AbstractContextManager[Any]] = nullcontext
    # Made once per ingress replica, handed to `plan` and `output` (e.g. a store of responses).
    state: Callable[[ServerOptions], Any] | None = None
    # A request that is several (a list of prompts): one plan per worker call, each
    # translated on its own; their chunks merge into one stream (choice i of part p is
    # choice p * n + i), which `output`, made from the whole plan, answers.
    split: Callable[[Plan], list[Plan]] | None = None
    # The route's errors as a response in the dialect's own shape (Anthropic's); None: OpenAI's.
    error_response: Callable[[APIError], Response] | None = None
