"""What the OpenAI-style dialects share: request and response bases, the sampling fields'
rules, `response_format`, stop strings, usage.

Unknown request fields are ignored (as vLLM does), so clients written for other servers
keep working; every field this server knows is honoured. Response models mark every
always-present field as required and every extra optional: they are dumped with
`exclude_unset`, so an extra appears only when the server set it.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict

from serve_app.dialects.response_format import guided_decoding
from workers.contract.chunks import GenerationChunk


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


def beam_search_error(req) -> tuple[str, str] | None:
    """(param, message) when a beam-search request breaks the MaaS rules (seed 003):
    n > 1, temperature 0, top_p 1, top_k -1 (or 0); no logprobs. Any route's request."""
    if req.n < 2:
        return "n", "beam search needs n > 1"
    if req.best_of is not None and req.best_of < req.n:
        return "best_of", f"best_of ({req.best_of}) must be at least n ({req.n})"
    if req.temperature not in (None, 0.0):
        return "temperature", "beam search needs temperature 0"
    if req.top_p not in (None, 1.0):
        return "top_p", "beam search needs top_p 1"
    if req.top_k not in (None, -1, 0):
        return "top_k", "beam search needs top_k -1"
    if req.logprobs is not None and req.logprobs is not False:  # completions' logprobs=0 asks too
        return "logprobs", "logprobs are not available with beam search"
    response_format = getattr(req, "response_format", None)
    if response_format is not None and response_format.type != "text":
        return "response_format", "structured output (response_format) is not available with beam search"
    return None


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


class ModelList(ResponseModel):
    object: Literal["list"]
    data: list[ModelCard]


def openai_sampling_kwargs(req) -> dict:
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
        guided=guided_decoding(req.response_format),
    )


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

