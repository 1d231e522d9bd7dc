"""What the OpenAI-style dialects share: request and response bases, the sampling fields
and their rules, stop strings, usage.

Unknown request fields are ignored (as vLLM does), so clients written for other servers
keep working; every field this server knows is honoured. Every rule between fields is a
model validator, so a request that breaks one fails validation (`parse_request`) with a
400 naming the field, before translation. Response models mark every always-present
field as required and every extra optional: they are dumped with `exclude_unset`, so an
extra appears only when the server set it.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from serve_app.http.errors import APIError, field_rule
from serve_app.schema.response_format import ResponseFormat, guided_decoding
from serve_app.schema.structured_outputs import (
    StructuredOutputFields,
    structured_guided,
)
from workers.contract.chunks import GenerationChunk
from workers.contract.sampling_params import GuidedDecoding


class RequestModel(BaseModel):
    """Base of every request model of every route: unknown fields are ignored."""

    model_config = ConfigDict(extra="ignore")


def or_default(value, default):
    """JSON null and an absent field both mean the documented default."""
    return default if value is None else value


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


MAX_STOP_STRINGS = 256


MAX_LOGPROBS = 20


def _check_stops(stop: str | list[str] | None) -> str | list[str] | None:
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if any(s == "" for s in stops):
        raise ValueError("stop strings must be non-empty")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    return stop


# The `stop` field of every route: a string or a list of non-empty strings, at most 256.
StopStrings = Annotated[str | list[str] | None, AfterValidator(_check_stops)]


def stop_tuple(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


# ------------------------------------------------------------------ rules between fields


def field_error(param: str, message: str) -> APIError:
    """A broken rule between fields: a 400 naming the field to change."""
    return APIError(400, message, param=param)


def check_stream_options(stream: bool, stream_options: object | None) -> None:
    # A plain ValueError: this rule's 400 names no param (as it always has).
    if stream_options is not None and not stream:
        raise ValueError("stream_options is only allowed when stream is true")


def beam_search_error(req: SamplingFields, asks_logprobs: bool) -> APIError | None:
    """When a beam-search request breaks the MaaS rules (seed 003): n > 1, temperature 0,
    top_p 1, top_k -1 (or 0); no logprobs; no response_format."""
    if req.n < 2:
        return field_error("n", "beam search needs n > 1")
    if req.best_of is not None and req.best_of < req.n:
        return field_error("best_of", f"best_of ({req.best_of}) must be at least n ({req.n})")
    if req.temperature not in (None, 0.0):
        return field_error("temperature", "beam search needs temperature 0")
    if req.top_p not in (None, 1.0):
        return field_error("top_p", "beam search needs top_p 1")
    if req.top_k not in (None, -1, 0):
        return field_error("top_k", "beam search needs top_k -1")
    if asks_logprobs:
        return field_error("logprobs", "logprobs are not available with beam search")
    if req.response_format is not None and req.response_format.type != "text":
        return field_error("response_format", "structured output (response_format) is not available with beam search")
    return None


def length_penalty_error(length_penalty: float | None) -> APIError | None:
    """Outside beam search a length penalty would be ignored: refused, not dropped."""
    if length_penalty is not None and length_penalty != 1.0:
        return field_error("length_penalty", "length_penalty needs use_beam_search: true")
    return None


def min_tokens_error(min_tokens: int | None, output_cap: int | None) -> APIError | None:
    if min_tokens and output_cap is not None and min_tokens > output_cap:
        return field_error("min_tokens", f"min_tokens ({min_tokens}) is larger than max_tokens ({output_cap})")
    return None


def logit_bias_error(logit_bias: dict[str, float] | None) -> APIError | None:
    """Keys are token ids, as JSON object keys (text: "123"); biases in [-100, 100].
    Whether an id is in the vocabulary is checked by the ingress, which knows the model."""
    for key, bias in (logit_bias or {}).items():
        if token_id(key) is None:
            return field_error("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if not -100.0 <= bias <= 100.0:
            return field_error("logit_bias", f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
    return None


def token_id(key: str) -> int | None:
    """The non-negative token id a logit_bias key names, else None ("-0" is 0)."""
    digits = key[1:] if key.startswith("-") else key
    if not digits.isdecimal():  # what int() reads; isdigit() would pass superscripts
        return None
    try:
        value = int(key)
    except ValueError:  # more digits than int() converts
        return None
    return value if value >= 0 else None


# ------------------------------------------------------------------------ sampling fields


class SamplingFields(StructuredOutputFields, RequestModel):
    """The fields /v1/chat/completions and /v1/completions share, and the rules between
    them. A dialect adds its own fields and rules (`broken_rule`), which run in the same
    validation, after `stream_options`'s."""

    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)  # None: 1.0
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)  # None: 1.0
    top_k: int | None = Field(None, ge=-1)  # None, 0 and -1: off
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None  # JSON keys are text: "123" (logit_bias_error)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    stop: StopStrings = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    ignore_eos: bool = False
    min_tokens: int | None = Field(None, ge=0)
    n: int = Field(1, ge=1, le=64)
    user: str | None = None

    use_beam_search: bool | None = False
    best_of: int | None = Field(None, ge=1, le=64)
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0, allow_inf_nan=False)

    response_format: ResponseFormat = None
    # vLLM's: lower runs first when the model's engine.scheduling_policy is `priority`; with
    # `fcfs` (the default) a non-zero value is refused by the worker (400 naming `priority`).
    priority: int = Field(0, ge=-(2**63), le=2**63 - 1)

    @model_validator(mode="after")
    def _rules_between_fields(self) -> Self:
        check_stream_options(self.stream, self.stream_options)
        if (error := self.broken_rule()) is not None:
            raise field_rule(error)
        return self

    def broken_rule(self) -> APIError | None:
        """The first rule between fields the request breaks, else None. These are the
        shared rules that hold with or without beam search; a dialect puts its own around
        them."""
        return min_tokens_error(self.min_tokens, self.output_cap) or logit_bias_error(self.logit_bias)

    @property
    def output_cap(self) -> int | None:
        """The most tokens the answer may have; None: the model's `default_max_tokens`, within
        the context window (the worker applies it)."""
        return self.max_tokens

    @property
    def stop_list(self) -> tuple[str, ...]:
        return stop_tuple(self.stop)


class ResponseModel(BaseModel):
    """Dumped with exclude_unset: optional extras appear only when the server set them."""

    def dump(self) -> dict:
        return self.model_dump(exclude_unset=True)

    def dump_json(self) -> str:
        return self.model_dump_json(exclude_unset=True)


class CompletionTokensDetails(ResponseModel):
    reasoning_tokens: int


class PromptTokensDetails(ResponseModel):
    cached_tokens: int


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None  # set for reasoning models
    prompt_tokens_details: PromptTokensDetails | None = None  # when the worker reports prefix-cache hits


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # a LoRA adapter: its directory (as vLLM lists it)
    parent: str | None = None  # a LoRA adapter: the served model it adapts


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


def openai_sampling_kwargs(req: SamplingFields) -> dict:
    """SamplingParams fields that /v1/chat/completions and /v1/completions name and
    default alike (temperature excepted: its default depends on the route)."""
    return dict(
        top_p=or_default(req.top_p, 1.0),
        top_k=req.top_k if req.top_k is not None and req.top_k > 0 else 0,
        min_p=or_default(req.min_p, 0.0),
        seed=req.seed,
        presence_penalty=or_default(req.presence_penalty, 0.0),
        frequency_penalty=or_default(req.frequency_penalty, 0.0),
        repetition_penalty=or_default(req.repetition_penalty, 1.0),
        logit_bias={int(k): float(v) for k, v in (req.logit_bias or {}).items()},
        ignore_eos=req.ignore_eos,
        min_tokens=or_default(req.min_tokens, 0),
        stop=req.stop_list,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
        guided=output_constraint(req),
        priority=req.priority,
    )


def output_constraint(req: SamplingFields) -> GuidedDecoding | None:
    """The answer's one constraint: `response_format`'s or a structured-output field's."""
    structured = structured_guided(req)
    formatted = guided_decoding(req.response_format)
    if structured is not None and formatted is not None:
        raise APIError(400, f"{structured.param} cannot be combined with a JSON response_format: one "
                       "structured output a request", param=structured.param)
    return structured or formatted


def usage_of(chunk: GenerationChunk, reasoning_tokens: int | None = None) -> Usage:
    usage = Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        total_tokens=chunk.prompt_tokens + chunk.completion_tokens,
    )
    if reasoning_tokens is not None:
        usage.completion_tokens_details = CompletionTokensDetails(reasoning_tokens=reasoning_tokens)
    if chunk.cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=chunk.cached_tokens)
    return usage

