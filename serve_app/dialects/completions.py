"""`POST /v1/completions`: OpenAI's legacy text completion.

The prompt is sent to the worker as text (`GenerateRequest.prompt`), which tokenizes
it with the tokenizer's special tokens (BOS where the model has one) and no chat
template. Sampling fields mean what they mean on /v1/chat/completions.

- `prompt`: a string, a list of token ids (fed to the model as they are: no BOS added),
  or a list of up to 64 of those. Each prompt of a list is its own worker call with its own
  `n` choices, merged into one answer (serve_app/transport/fan_out.py): prompt p's choice i
  has index `p * n + i`, and usage counts every prompt. An id outside the vocabulary is a
  400 naming `prompt` (the worker's check), as is an empty prompt.
- `max_tokens`: default 16, as OpenAI; `null` means the model's `default_max_tokens`.
- `echo: true` puts the prompt in front of the text (in a stream: in front of the first
  text event).
- `n`: that many choices, sharing one prefill (greedy with n > 1 is a 400, as on chat).
- `best_of` (> n, sampling): best_of samples are drawn and the n with the highest
  cumulative log-probability are returned (vLLM's rule; OpenAI ranks per token); it
  cannot stream (400, as OpenAI). With `use_beam_search`, `best_of` is the beam width
  and the chat route's beam rules apply (n > 1, temperature 0, top_p 1, top_k -1).
- `logprobs: k` (0..20): OpenAI's legacy shape per choice: `tokens`, `token_logprobs`,
  `top_logprobs` (the k most likely, token -> logprob), `text_offset`. With `echo`
  (prompt logprobs in this shape) it is a 400 naming `logprobs`.
- `response_format` constrains the text as on /v1/chat/completions (json_object,
  json_schema; serve_app/schema/response_format.py).
- `suffix` (insertion) gets a 400 naming the field: not supported.
- Penalties (`presence_penalty`, `frequency_penalty`, `repetition_penalty`), `min_p`,
  `min_tokens` and `logit_bias` are passed to the worker's SamplingParams.
- Response: `{id, object: "text_completion", created, model, choices: [{index, text,
  logprobs, finish_reason, stop_reason?}], usage}`; `finish_reason` is `stop` (EOS,
  stop token or stop string) or `length`.
- Stream: `text_completion` chunks with `choices: [{index, text, logprobs,
  finish_reason}]` (the choices of n > 1 interleave), then `data: [DONE]`. With `stream_options.include_usage` every
  chunk has `usage: null` and one more chunk with `choices: []` carries the usage, as
  OpenAI does; `continuous_usage_stats` puts the running usage on every chunk, as vLLM does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from serve_app.http.errors import APIError, unsupported
from serve_app.http.sse import sse, sse_json
from serve_app.schema.common import (
    MAX_LOGPROBS,
    RequestModel,
    ResponseModel,
    SamplingFields,
    Usage,
    beam_search_error,
    field_error,
    length_penalty_error,
    openai_sampling_kwargs,
    or_default,
    usage_of,
)
from serve_app.schema.dialect import CallContext, Dialect
from workers.contract.chunks import GenerationChunk, TokenLogprob
from workers.contract.model_config import ModelConfig
from workers.contract.requests import GenerateRequest
from workers.contract.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16

# The worker names request fields as /v1/chat/completions does.
WORKER_PARAM_NAMES = {"messages": "prompt"}


def new_request_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


MAX_PROMPTS = 64  # a list of prompts is that many worker calls
TokenIds = list[Annotated[int, Field(ge=0)]]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value)


class TextPrompt(RequestModel):
    """What a completion request asks of which model: one prompt (text or token ids), or a
    list of them (each its own set of choices)."""

    model: str
    prompt: str | TokenIds | list[str | TokenIds]

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, prompt: Any) -> Any:
        if _is_token_ids(prompt):
            return prompt  # one token-id prompt
        if isinstance(prompt, list):
            if not 1 <= len(prompt) <= MAX_PROMPTS:
                raise ValueError(f"a list of 1 to {MAX_PROMPTS} prompts, got {len(prompt)}")
            if any(isinstance(p, (str, list)) and not p for p in prompt):
                raise ValueError("prompt must not be empty")
            if len(prompt) == 1:
                prompt = prompt[0]
        if isinstance(prompt, (str, list)) and not prompt:
            raise ValueError("prompt must not be empty")
        return prompt

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request (one, unless a list of several was sent)."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return [self.prompt]
        return list(self.prompt)

    @property
    def prompt_text(self) -> str | None:
        return self.prompt if isinstance(self.prompt, str) else None


# TextPrompt is the last base so its fields come first: a request with several bad fields
# is answered about the first, and the model and prompt lead, as in OpenAI's order.
class CompletionRequest(SamplingFields, TextPrompt):
    suffix: str | None = None
    max_tokens: int | None = Field(DEFAULT_MAX_TOKENS, ge=1)  # null: the model's default_max_tokens
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def broken_rule(self) -> APIError | None:
        if (error := super().broken_rule()) is not None:
            return error
        if self.suffix:
            return unsupported("suffix", "is not supported on /v1/completions")
        return self._choices_error()

    def _choices_error(self) -> APIError | None:
        """n, best_of, beam search and logprobs; beam search has rules of its own."""
        if self.use_beam_search:
            return beam_search_error(self, asks_logprobs=self.logprobs is not None)
        if (error := length_penalty_error(self.length_penalty)) is not None:
            return error
        if self.best_of is not None and self.best_of < self.n:
            return field_error("best_of", f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.num_samples > self.n and self.stream:
            return field_error("best_of", "best_of > n cannot stream: the best choices are known only at the end")
        greedy = self.temperature == 0 or self.top_k == 1
        if self.num_samples > 1 and greedy:
            param = "n" if self.n > 1 else "best_of"
            return field_error(param, f"{param} > 1 needs sampling: greedy decoding (temperature 0 or top_k 1) "
                               "gives identical choices")
        if self.echo and not all(isinstance(p, str) for p in self.prompts):
            return field_error("echo", "echo needs text prompts (token ids were sent)")
        if self.logprobs is not None and self.echo:
            return field_error("logprobs", "logprobs with echo (prompt logprobs) are not supported; drop one of them")
        return None

    @property
    def num_samples(self) -> int:
        """Choices the engine draws: best_of when it ranks them (sampling), else n."""
        return self.n if self.use_beam_search else max(self.n, self.best_of or self.n)


def split_prompts(req: CompletionRequest) -> list[CompletionRequest]:
    """A request with a list of prompts as one request per prompt (the same fields)."""
    prompts = req.prompts
    return [req] if len(prompts) == 1 else [req.model_copy(update={"prompt": p}) for p in prompts]


def to_generate_request(req: CompletionRequest, request_id: str, model: ModelConfig | None = None) -> GenerateRequest:
    """`req` has passed every rule of the dialect (its validation); what is left to fail
    here is a `response_format` schema llguidance cannot build (400). `model` (the served
    model's config) changes nothing here."""
    ranked = req.num_samples > req.n  # best_of ranks by cumulative logprob: the worker must report them
    params = SamplingParams(
        **openai_sampling_kwargs(req),
        temperature=0.0 if req.use_beam_search else or_default(req.temperature, 1.0),
        logprobs=req.logprobs if req.logprobs is not None else (0 if ranked else None),
        n=req.num_samples,
        use_beam_search=bool(req.use_beam_search),
        best_of=req.best_of if req.use_beam_search else None,
        length_penalty=or_default(req.length_penalty, 1.0),
    )
    token_ids = None if isinstance(req.prompt, str) else tuple(req.prompt)
    return GenerateRequest(request_id=request_id, params=params, prompt=req.prompt_text, prompt_token_ids=token_ids,
                           max_tokens=req.max_tokens)


# ---------------------------------------------------------------------------- response


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy per-choice logprobs: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


def legacy_logprobs(items: list[TokenLogprob], offset: int) -> CompletionLogprobs:
    """Legacy logprobs for `items`, whose text starts at character `offset` of the choice."""
    offsets = []
    for item in items:
        offsets.append(offset)
        offset += len(item.token)
    return CompletionLogprobs(
        tokens=[t.token for t in items],
        token_logprobs=[t.logprob for t in items],
        top_logprobs=[{x.token: x.logprob for x in t.top_logprobs} for t in items],
        text_offset=offsets,
    )


class _Choice:
    """What one choice has produced so far."""

    def __init__(self, prefix: str) -> None:
        self.texts = [prefix] if prefix else []
        self.logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.texts.append(chunk.text)
        self.logprobs.extend(chunk.logprobs or [])
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason

    @property
    def cumulative_logprob(self) -> float:
        return sum(t.logprob for t in self.logprobs)


class CompletionAccumulator:
    """Folds worker chunks (of all choices) into one `text_completion`; with best_of > n
    it keeps the n choices of highest cumulative log-probability."""

    def __init__(self, request_id: str, req: CompletionRequest) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        self.n = req.n
        self.num_samples = req.num_samples
        self.show_logprobs = req.logprobs is not None
        self.choices = [_Choice(prompt if req.echo else "") for prompt in req.prompts for _ in range(req.num_samples)]
        self.last = GenerationChunk()

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise APIError.from_info(chunk.error, WORKER_PARAM_NAMES)
        self.choices[chunk.index].add(chunk)
        self.last = chunk

    def result(self) -> Completion:
        kept = []
        for first in range(0, len(self.choices), self.num_samples):  # each prompt's choices
            drawn = self.choices[first : first + self.num_samples]
            if len(drawn) > self.n:
                drawn = sorted(drawn, key=lambda c: c.cumulative_logprob, reverse=True)[: self.n]
            kept.extend(drawn)
        choices = [
            CompletionChoice(index=i, text="".join(c.texts),
                             logprobs=legacy_logprobs(c.logprobs, 0) if self.show_logprobs else None,
                             finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for i, c in enumerate(kept)
        ]
        return Completion(id=self.request_id, object="text_completion", created=self.created, model=self.model,
                          choices=choices, usage=usage_of(self.last))


class CompletionStreamer:
    """Turns worker chunks into `text_completion` SSE events (n choices interleave)."""

    def __init__(self, request_id: str, req: CompletionRequest) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.show_logprobs = req.logprobs is not None
        self.echo = [prompt if req.echo else "" for prompt in req.prompts for _ in range(req.n)]  # not yet sent
        self.offsets = [0] * len(self.echo)  # characters sent, per choice (legacy text_offset)

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        chunk: GenerationChunk | None = first
        last = first
        while chunk is not None:
            if chunk.error is not None:
                yield sse(APIError.from_info(chunk.error, WORKER_PARAM_NAMES).body())
                break
            choice = self._choice(chunk)
            if choice is not None:
                usage = usage_of(chunk) if self.continuous_usage else None
                yield self._event([choice], usage)
            last = chunk
            chunk = await anext(rest, None)
        else:
            if self.include_usage:
                yield self._event([], usage_of(last))
        yield "data: [DONE]\n\n"

    def _choice(self, chunk: GenerationChunk) -> CompletionChoice | None:
        i = chunk.index
        text, self.echo[i] = self.echo[i] + chunk.text, ""
        if not text and chunk.finish_reason is None:
            return None  # text held back (partial UTF-8 or a possible stop string)
        logprobs = legacy_logprobs(chunk.logprobs or [], self.offsets[i]) if self.show_logprobs else None
        self.offsets[i] += len(text)
        choice = CompletionChoice(index=i, text=text, logprobs=logprobs, finish_reason=chunk.finish_reason)
        if chunk.finish_reason is not None and chunk.stop_reason is not None:
            choice.stop_reason = chunk.stop_reason
        return choice

    def _event(self, choices: list[CompletionChoice], usage: Usage | None) -> str:
        event = Completion(id=self.request_id, object="text_completion", created=self.created, model=self.model,
                           choices=choices)
        if usage is not None or self.include_usage:
            event.usage = usage  # null on every chunk but the last when include_usage, as OpenAI
        return sse_json(event.dump_json())


# ------------------------------------------------------------------------------- route


def output(req: CompletionRequest, request_id: str, context: CallContext,
           stream: bool) -> CompletionStreamer | CompletionAccumulator:
    return CompletionStreamer(request_id, req) if stream else CompletionAccumulator(request_id, req)


COMPLETIONS = Dialect(path="/v1/completions", request_model=CompletionRequest, new_id=new_request_id,
                      translate=to_generate_request, output=output, param_names=WORKER_PARAM_NAMES,
                      split=split_prompts)
