"""`POST /v1/completions`: OpenAI's legacy text completion, one prompt a request.

The prompt is sent to the worker as text (`GenerateRequest.prompt`), which tokenizes
it with the tokenizer's special tokens (BOS where the model has one) and no chat
template. Sampling fields mean what they mean on /v1/chat/completions.

- `prompt`: a string, or a list holding one string. Token-id prompts and lists of
  several prompts get a 400 naming `prompt` (send one request per prompt).
- `max_tokens`: default 16, as OpenAI; `null` means the rest of the context window.
- `echo: true` puts the prompt in front of the text (in a stream: in front of the first
  text event).
- `response_format` constrains the text as on /v1/chat/completions (json_object,
  json_schema; serve_app/structured_output.py).
- `suffix` (insertion), `n > 1`, `best_of > 1`, `logprobs`, `use_beam_search` get a 400
  naming the field: not supported.
- Penalties (`presence_penalty`, `frequency_penalty`, `repetition_penalty`), `min_p`,
  `min_tokens` and `logit_bias` are passed to the worker's SamplingParams.
- Response: `{id, object: "text_completion", created, model, choices: [{index, text,
  logprobs: null, finish_reason, stop_reason?}], usage}`; `finish_reason` is `stop` (EOS,
  stop token or stop string) or `length`.
- Stream: `text_completion` chunks with `choices: [{index, text, logprobs: null,
  finish_reason}]`, then `data: [DONE]`. With `stream_options.include_usage` every
  chunk has `usage: null` and one more chunk with `choices: []` carries the usage, as
  OpenAI does; `continuous_usage_stats` puts the running usage on every chunk, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from serve_app.chat_completions import openai_sampling_kwargs, sse, sse_json, usage_of
from serve_app.errors import APIError, unsupported
from serve_app.protocol import (
    RequestModel,
    ResponseFormat,
    ResponseModel,
    StopStrings,
    StreamOptions,
    Usage,
    or_default,
    stop_tuple,
)
from workers.protocol import GenerateRequest, GenerationChunk
from workers.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16

# The worker names request fields as /v1/chat/completions does.
WORKER_PARAM_NAMES = {"messages": "prompt"}


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


class CompletionRequest(RequestModel):
    model: str
    prompt: str
    suffix: str | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)  # None: 1.0
    top_k: int | None = Field(None, ge=-1)  # None, 0 and -1: off
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopStrings = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    min_tokens: int | None = Field(None, ge=0)
    logit_bias: dict[int, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    echo: bool = False
    user: str | None = None
    response_format: ResponseFormat = None  # as on /v1/chat/completions (vLLM takes it here too)

    # Known, not supported: any non-neutral value is a 400 (see unsupported_field).
    n: int | None = 1
    best_of: int | None = None
    logprobs: int | None = None
    use_beam_search: bool | None = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_text_prompt(cls, prompt: Any) -> Any:
        if isinstance(prompt, list):
            if any(isinstance(p, (int, list)) for p in prompt):
                raise ValueError("token-id prompts are not supported; send the prompt as a string")
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request: got a list of {len(prompt)}; send a string")
            prompt = prompt[0]
        if isinstance(prompt, str) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float] | None) -> dict[int, float] | None:
        for token_id, value in (bias or {}).items():
            if token_id < 0:
                raise ValueError(f"token id {token_id} is negative")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"bias {value} for token {token_id} is outside [-100, 100]")
        return bias

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "CompletionRequest":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if self.min_tokens and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        return self

    def unsupported_field(self) -> str | None:
        if self.suffix:
            return "suffix"
        if self.n not in (None, 1):
            return "n"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.logprobs is not None:
            return "logprobs"
        if self.use_beam_search:
            return "use_beam_search"
        return None

    @property
    def stop_list(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)



def to_generate_request(req: CompletionRequest, request_id: str) -> GenerateRequest:
    field = req.unsupported_field()
    if field is not None:
        raise unsupported(field, "is not supported on /v1/completions")
    params = SamplingParams(**openai_sampling_kwargs(req), temperature=or_default(req.temperature, 1.0))
    return GenerateRequest(request_id=request_id, params=params, prompt=req.prompt, max_tokens=req.max_tokens)


# ---------------------------------------------------------------------------- response


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: str | None
    stop_reason: int | str | None = None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None




class CompletionAccumulator:
    """Folds worker chunks into one `text_completion`."""

    def __init__(self, request_id: str, req: CompletionRequest) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        self.texts: list[str] = [req.prompt] if req.echo else []
        self.last = GenerationChunk()

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise APIError.from_info(chunk.error, WORKER_PARAM_NAMES)
        self.texts.append(chunk.text)
        self.last = chunk

    def result(self) -> Completion:
        choice = CompletionChoice(index=0, text="".join(self.texts), logprobs=None,
                                  finish_reason=self.last.finish_reason, stop_reason=self.last.stop_reason)
        return Completion(id=self.request_id, object="text_completion", created=self.created, model=self.model,
                          choices=[choice], usage=usage_of(self.last))


class CompletionStreamer:
    """Turns worker chunks into `text_completion` SSE events."""

    def __init__(self, request_id: str, req: CompletionRequest) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.echo = req.prompt if req.echo else ""

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        chunk: GenerationChunk | None = first
        last = first
        while chunk is not None:
            if chunk.error is not None:
                yield sse(APIError.from_info(chunk.error, WORKER_PARAM_NAMES).body())
                break
            text, self.echo = self.echo + chunk.text, ""
            if text or chunk.finish_reason is not None:  # else: text held back
                choice = CompletionChoice(index=0, text=text, logprobs=None, finish_reason=chunk.finish_reason)
                if chunk.finish_reason is not None and chunk.stop_reason is not None:
                    choice.stop_reason = chunk.stop_reason
                usage = usage_of(chunk) if self.continuous_usage else None
                yield self._event([choice], usage)
            last = chunk
            chunk = await anext(rest, None)
        else:
            if self.include_usage:
                yield self._event([], usage_of(last))
        yield "data: [DONE]\n\n"

    def _event(self, choices: list[CompletionChoice], usage: Usage | None) -> str:
        event = Completion(id=self.request_id, object="text_completion", created=self.created, model=self.model,
                           choices=choices)
        if usage is not None or self.include_usage:
            event.usage = usage  # null on every chunk but the last when include_usage, as OpenAI
        return sse_json(event.dump_json())
