"""`/v1/chat/completions`: request -> worker request, worker chunks -> OpenAI responses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serve_app.errors import APIError
from serve_app.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    LogprobEntry,
    PromptTokensDetails,
    TopLogprobEntry,
    Usage,
    or_default,
)
from workers.protocol import GenerateRequest, GenerationChunk, TokenLogprob, TopLogprob
from workers.sampling_params import SamplingParams


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def to_generate_request(req: ChatCompletionRequest, request_id: str) -> GenerateRequest:
    unsupported = req.unsupported_field()
    if unsupported is not None:
        raise APIError(400, f"`{unsupported}` is not supported by this server yet", param=unsupported,
                       code="unsupported_parameter")
    rule = req.cross_field_error()
    if rule is not None:
        raise APIError(400, rule[1], param=rule[0])
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    return GenerateRequest(
        request_id=request_id,
        params=sampling_params(req),
        messages=messages,
        max_tokens=req.output_cap,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
    )


def sampling_params(req: ChatCompletionRequest) -> SamplingParams:
    """The request's sampling fields with OpenAI's defaults for those left out."""
    return SamplingParams(
        **openai_sampling_kwargs(req),
        temperature=0.0 if req.use_beam_search else or_default(req.temperature, 1.0),
        logprobs=or_default(req.top_logprobs, 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        n=req.n,
        use_beam_search=bool(req.use_beam_search),
        best_of=req.best_of,
        length_penalty=or_default(req.length_penalty, 1.0),
    )


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
    )


def logprob_entries(items: list[TokenLogprob]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            LogprobEntry(
                token=t.token,
                logprob=t.logprob,
                bytes=list(t.token.encode("utf-8")),
                top_logprobs=[
                    TopLogprobEntry(token=x.token, logprob=x.logprob, bytes=list(x.token.encode("utf-8")))
                    for x in t.top_logprobs
                ],
            )
            for t in items
        ]
    )


def prompt_logprob_entries(items: list[dict[int, TopLogprob] | None]) -> list[dict[str, dict] | None]:
    """vLLM's shape: per prompt token, {token id: {logprob, decoded_token}}; the first is null."""
    return [
        None if entry is None
        else {str(tid): {"logprob": x.logprob, "decoded_token": x.token} for tid, x in entry.items()}
        for entry in items
    ]


@dataclass
class _ChoiceState:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionAccumulator:
    """Folds worker chunks (of all n choices) into one non-streaming `chat.completion`."""

    def __init__(self, request_id: str, model: str, n: int = 1) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.choices = [_ChoiceState() for _ in range(n)]
        self.last: GenerationChunk | None = None
        self.prompt_logprobs: list | None = None
        self.prefill_time: float | None = None
        self.decode_times: list[float] = []

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise APIError.from_info(chunk.error)
        state = self.choices[chunk.index]
        state.texts.append(chunk.text)
        if chunk.logprobs is not None:
            state.logprobs = (state.logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None:
            state.finish_reason, state.stop_reason = chunk.finish_reason, chunk.stop_reason
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprob_entries(chunk.prompt_logprobs)
        if chunk.index == 0:  # MindIE timings describe the (first) answer
            if chunk.prefill_time_ms is not None:
                self.prefill_time = round(chunk.prefill_time_ms, 3)
            self.decode_times.extend(round(t, 3) for t in chunk.decode_times_ms)
        self.last = chunk

    def result(self) -> ChatCompletion:
        choices = [
            Choice(
                index=i,
                message=AssistantMessage(role="assistant", content="".join(s.texts)),
                logprobs=None if s.logprobs is None else logprob_entries(s.logprobs),
                finish_reason=s.finish_reason,
                stop_reason=s.stop_reason,
            )
            for i, s in enumerate(self.choices)
        ]
        response = ChatCompletion(
            id=self.request_id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(self.last or GenerationChunk()),
            prefill_time=self.prefill_time,
            decode_time_arr=self.decode_times,
        )
        if self.prompt_logprobs is not None:
            response.prompt_logprobs = self.prompt_logprobs
        return response


class ChunkStreamer:
    """Turns worker chunks into `chat.completion.chunk` SSE events."""

    def __init__(self, request_id: str, req: ChatCompletionRequest, full_text_enabled: bool) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.full_text_enabled = full_text_enabled
        self.full_texts = [""] * req.n

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        """SSE lines; an error after the stream began is a last event before [DONE]."""
        try:
            async for chunk in self.chunks(first, rest):
                yield sse_json(chunk.dump_json())
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    async def chunks(
        self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]
    ) -> AsyncIterator[ChatCompletionChunk]:
        """`chat.completion.chunk` objects (for SSE, or for Python callers of the handle API);
        a worker error raises APIError."""
        chunk: GenerationChunk | None = first
        last = first
        while chunk is not None:
            if chunk.error is not None:
                raise APIError.from_info(chunk.error)
            event = self._chunk_event(chunk)
            if event is not None:
                yield event
            last = chunk
            chunk = await anext(rest, None)
        if self.include_usage:
            yield self._usage_event(last)

    def _chunk_event(self, chunk: GenerationChunk) -> ChatCompletionChunk | None:
        self.full_texts[chunk.index] += chunk.text
        has_news = chunk.text or chunk.finish_reason is not None or chunk.logprobs or chunk.prompt_logprobs
        if not has_news:
            return None  # text held back (partial UTF-8 or a possible stop string)
        content = self.full_texts[chunk.index] if self.full_text_enabled else chunk.text
        choice = ChunkChoice(
            index=chunk.index,
            delta=Delta(role="assistant", content=content),
            logprobs=None if chunk.logprobs is None else logprob_entries(chunk.logprobs),
            finish_reason=chunk.finish_reason,
        )
        if chunk.finish_reason is not None and chunk.stop_reason is not None:
            choice.stop_reason = chunk.stop_reason
        event = self._envelope([choice])
        if self.continuous_usage:
            event.usage = usage_of(chunk)
        if self.full_text_enabled and chunk.finish_reason is not None:
            # MindIE's fullTextEnabled stream (seeds 000/001): the last chunk adds full_text and usage.
            event.full_text = self.full_texts[chunk.index]
            event.usage = usage_of(chunk)
        if chunk.prompt_logprobs is not None:
            event.prompt_logprobs = prompt_logprob_entries(chunk.prompt_logprobs)
        return event

    def _usage_event(self, last: GenerationChunk) -> ChatCompletionChunk:
        event = self._envelope([])
        event.usage = usage_of(last)
        return event

    def _envelope(self, choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices
        )


def usage_of(chunk: GenerationChunk) -> Usage:
    usage = Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        total_tokens=chunk.prompt_tokens + chunk.completion_tokens,
    )
    if chunk.cached_tokens is not None:
        usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=chunk.cached_tokens)
    return usage


def sse(payload: dict) -> str:
    return sse_json(json.dumps(payload, ensure_ascii=False))


def sse_json(text: str) -> str:
    return f"data: {text}\n\n"
