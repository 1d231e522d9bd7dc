"""`POST /lm/v2/chat/completions`: the `004` chat dialect, all of it in this module.

Everything that differs from `/v1/chat/completions` is here: the request model and its
rules, the translation to the worker's `GenerateRequest`, the finish reasons, and the
response and stream-chunk shapes. The rest is shared with `/v1`: the worker call (first
chunk awaited, cancel on client exit; serve_app/transport/worker_call.py), the error shape and status
codes (serve_app/http/errors.py), the API keys (serve_app/http/auth.py).

Request:
- `messages`: non-empty, an odd count, roles alternating `user` (or `function`) and
  `assistant`, starting and ending with `user`/`function`; no `system`. Content is a
  string. Any violation is a 400 with `param: "messages"`. A `function` message reaches
  the chat template as role `tool`, the name templates give a function's result.
- `temperature`: default 0.95, range (0, 1]; 0 is an error (for greedy, send `top_k: 1`
  or `top_p: 0`).
- `top_p`: default 0.8, range [0, 1]. 0 means "only the most likely token": it is sent
  to the worker as `top_k = 1` with no nucleus cut (the sampler needs top_p > 0), which
  is greedy decoding.
- `top_k`: no default (off); 0 and -1 are off too, as on /v1.
- `penalty_score`: default 1.0, range [1, 2]: the multiplicative repetition penalty
  (`SamplingParams.repetition_penalty`). `presence_penalty`, `frequency_penalty`:
  default 0, range [-2, 2].
- `max_completion_tokens` caps the output (absent: the model's `default_max_tokens`);
  `stop` (string or list of non-empty strings); `stream`;
  `stream_options.include_usage` (only with `stream: true`).
- JSON `null` for an optional field means its default. Unknown fields are ignored, as on /v1.

Response:
- `finish_reason`: `normal` (the model ended it: EOS), `stop` (cut by a `stop` string),
  `length` (`max_completion_tokens` or the context window). The dialect also names
  `content_filter` and `tool_calls`; this server has neither a content filter nor tools,
  so it never produces them.
- Non-stream: `{id, object: "chat.completion", created, model, choices: [{index,
  message: {role, content}, finish_reason}], usage}`.
- Stream: `chat.completion.chunk` events; the first has `delta: {role: "assistant",
  content: ""}`, later ones `delta: {content}`; every chunk has `usage: null` except,
  with `stream_options.include_usage`, the last one (the one with `finish_reason`),
  which carries the usage; then `data: [DONE]`. An error after the stream started is a
  last `{"error": ...}` event before `[DONE]`, as on /v1.
- A thinking model's `<think>...</think>` stays inside `content` (the worker returns the
  raw text; nothing is split off).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from serve_app.http.errors import APIError
from serve_app.http.sse import sse, sse_json
from serve_app.schema.common import (
    RequestModel,
    StopStrings,
    check_stream_options,
    or_default,
    stop_tuple,
)
from serve_app.schema.dialect import CallContext, Dialect
from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams

DEFAULT_TEMPERATURE = 0.95
DEFAULT_TOP_P = 0.8
DEFAULT_PENALTY_SCORE = 1.0

# Every finish_reason the dialect defines; the last two are never produced here.
FINISH_REASONS = ("normal", "stop", "length", "content_filter", "tool_calls")

# The worker names request fields as /v1/chat/completions does.
WORKER_PARAM_NAMES = {"max_tokens": "max_completion_tokens"}

_USER_ROLES = ("user", "function")
_TEMPLATE_ROLES = {"function": "tool"}


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"  # the dialect's objects are chat completions too


# ----------------------------------------------------------------------------- request


class LmV2Message(RequestModel):
    role: str
    content: str
    name: str | None = None


class LmV2StreamOptions(RequestModel):
    include_usage: bool = False


class LmV2ChatRequest(RequestModel):
    model: str
    messages: list[LmV2Message]
    stream: bool = False
    stream_options: LmV2StreamOptions | None = None
    temperature: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)  # None: 0.95
    top_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)  # None: 0.8
    top_k: int | None = Field(None, ge=-1)  # None, 0, -1: off
    penalty_score: float | None = Field(None, ge=1.0, le=2.0, allow_inf_nan=False)  # None: 1.0
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)  # None: 0
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)  # None: 0
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: StopStrings = None

    @field_validator("messages")
    @classmethod
    def _alternating_turns(cls, messages: list[LmV2Message]) -> list[LmV2Message]:
        if not messages:
            raise ValueError("messages must not be empty")
        if len(messages) % 2 == 0:
            raise ValueError(
                f"messages must have an odd number of members (user, assistant, ..., user); got {len(messages)}"
            )
        for i, message in enumerate(messages):
            expected = _USER_ROLES if i % 2 == 0 else ("assistant",)
            if message.role not in expected:
                raise ValueError(
                    f"messages must alternate user (or function) and assistant, starting and ending with user: "
                    f"messages[{i}] has role {message.role!r}, expected {' or '.join(map(repr, expected))}"
                )
        return messages

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "LmV2ChatRequest":
        check_stream_options(self.stream, self.stream_options)
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)



def to_generate_request(req: LmV2ChatRequest, request_id: str, model: ModelConfig | None = None) -> GenerateRequest:
    """The dialect's request as the worker's: defaults filled in, names mapped (`model`, the
    served model's config, changes nothing here)."""
    top_p = or_default(req.top_p, DEFAULT_TOP_P)
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    if top_p == 0.0:  # only the most likely token: greedy (the sampler needs top_p > 0)
        top_p, top_k = 1.0, 1
    params = SamplingParams(
        temperature=or_default(req.temperature, DEFAULT_TEMPERATURE),
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=or_default(req.penalty_score, DEFAULT_PENALTY_SCORE),
        presence_penalty=or_default(req.presence_penalty, 0.0),
        frequency_penalty=or_default(req.frequency_penalty, 0.0),
        stop=req.stop_list,
    )
    messages = []
    for m in req.messages:
        message = {"role": _TEMPLATE_ROLES.get(m.role, m.role), "content": m.content}
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return GenerateRequest(request_id=request_id, params=params, messages=messages,
                           max_tokens=req.max_completion_tokens)


def finish_reason(chunk: GenerationChunk) -> str | None:
    """The worker's finish reason in the dialect's words.

    The worker says `stop` both for EOS (stop_reason None, or a stop token id) and for a
    stop string (stop_reason is that string); the dialect calls the first `normal`.
    `length` is the same word; anything else (`abort`: the client left) passes through.
    """
    reason = chunk.finish_reason
    if reason == "stop":
        return "stop" if isinstance(chunk.stop_reason, str) else "normal"
    return reason


# ---------------------------------------------------------------------------- response


class _Response(BaseModel):
    def dump_json(self) -> str:
        return self.model_dump_json()


class LmV2Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class LmV2AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class LmV2Choice(_Response):
    index: int
    message: LmV2AssistantMessage
    finish_reason: str | None


class LmV2Completion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[LmV2Choice]
    usage: LmV2Usage


class LmV2RoleDelta(_Response):
    role: Literal["assistant"] = "assistant"
    content: str = ""


class LmV2ContentDelta(_Response):
    content: str


class LmV2ChunkChoice(_Response):
    index: int
    delta: LmV2RoleDelta | LmV2ContentDelta
    finish_reason: str | None


class LmV2Chunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[LmV2ChunkChoice]
    usage: LmV2Usage | None = None  # always present; null except on the last chunk with include_usage


def usage_of(chunk: GenerationChunk) -> LmV2Usage:
    return LmV2Usage(prompt_tokens=chunk.prompt_tokens, completion_tokens=chunk.completion_tokens,
                     total_tokens=chunk.prompt_tokens + chunk.completion_tokens)


class LmV2Accumulator:
    """Folds worker chunks into one non-streaming response."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.texts: list[str] = []
        self.last = GenerationChunk()

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise APIError.from_info(chunk.error, WORKER_PARAM_NAMES)
        self.texts.append(chunk.text)
        self.last = chunk

    def result(self) -> LmV2Completion:
        choice = LmV2Choice(index=0, message=LmV2AssistantMessage(content="".join(self.texts)),
                            finish_reason=finish_reason(self.last))
        return LmV2Completion(id=self.request_id, created=self.created, model=self.model, choices=[choice],
                              usage=usage_of(self.last))


class LmV2Streamer:
    """Turns worker chunks into the dialect's SSE events."""

    def __init__(self, request_id: str, req: LmV2ChatRequest) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        self.include_usage = req.include_usage

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        yield self._event(LmV2RoleDelta(), None)
        chunk: GenerationChunk | None = first
        while chunk is not None:
            if chunk.error is not None:
                yield sse(APIError.from_info(chunk.error, WORKER_PARAM_NAMES).body())
                break
            reason = finish_reason(chunk)
            if chunk.text or reason is not None:  # else: text held back (partial UTF-8, possible stop string)
                usage = usage_of(chunk) if reason is not None and self.include_usage else None
                yield self._event(LmV2ContentDelta(content=chunk.text), reason, usage)
            chunk = await anext(rest, None)
        yield "data: [DONE]\n\n"

    def _event(self, delta: LmV2RoleDelta | LmV2ContentDelta, reason: str | None,
               usage: LmV2Usage | None = None) -> str:
        choice = LmV2ChunkChoice(index=0, delta=delta, finish_reason=reason)
        chunk = LmV2Chunk(id=self.request_id, created=self.created, model=self.model, choices=[choice], usage=usage)
        return sse_json(chunk.dump_json())


# ------------------------------------------------------------------------------- route


def output(req: LmV2ChatRequest, request_id: str, context: CallContext,
           stream: bool) -> LmV2Streamer | LmV2Accumulator:
    return LmV2Streamer(request_id, req) if stream else LmV2Accumulator(request_id, req.model)


# The request model has no token-id fields (logit_bias, stop_token_ids): the generate
# path's token-id check finds nothing to check here.
LM_V2 = Dialect(path="/lm/v2/chat/completions", request_model=LmV2ChatRequest, new_id=new_request_id,
                translate=to_generate_request, output=output, param_names=WORKER_PARAM_NAMES)
