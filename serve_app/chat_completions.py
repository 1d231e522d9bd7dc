"""`/v1/chat/completions`: request -> worker request, worker chunks -> OpenAI responses."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from serve_app.errors import APIError
from serve_app.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    Usage,
)
from workers.protocol import GenerateRequest, GenerationChunk
from workers.sampling_params import SamplingParams


def new_request_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def to_generate_request(req: ChatCompletionRequest, request_id: str) -> GenerateRequest:
    unsupported = req.unsupported_field()
    if unsupported is not None:
        raise APIError(400, f"`{unsupported}` is not supported by this server yet", param=unsupported,
                       code="unsupported_parameter")
    top_k = req.top_k if req.top_k is not None and req.top_k > 0 else 0
    params = SamplingParams(
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=req.seed,
        ignore_eos=req.ignore_eos,
        stop=req.stop_list,
        stop_token_ids=tuple(req.stop_token_ids or ()),
        include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens,
    )
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    return GenerateRequest(
        request_id=request_id,
        params=params,
        messages=messages,
        max_tokens=req.output_cap,
        chat_template_kwargs=dict(req.chat_template_kwargs or {}),
    )


class CompletionAccumulator:
    """Folds worker chunks into one non-streaming `chat.completion`."""

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.texts: list[str] = []
        self.last: GenerationChunk | None = None
        self.prefill_time: float | None = None
        self.decode_times: list[float] = []

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.error is not None:
            raise APIError.from_info(chunk.error)
        self.texts.append(chunk.text)
        if chunk.prefill_time_ms is not None:
            self.prefill_time = round(chunk.prefill_time_ms, 3)
        self.decode_times.extend(round(t, 3) for t in chunk.decode_times_ms)
        self.last = chunk

    def result(self) -> ChatCompletion:
        last = self.last or GenerationChunk()
        choice = Choice(
            index=0,
            message=AssistantMessage(role="assistant", content="".join(self.texts)),
            logprobs=None,
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
        )
        return ChatCompletion(
            id=self.request_id,
            object="chat.completion",
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=_usage(last),
            prefill_time=self.prefill_time,
            decode_time_arr=self.decode_times,
        )


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
        self.full_text = ""

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        chunk: GenerationChunk | None = first
        last = first
        while chunk is not None:
            if chunk.error is not None:
                yield sse(APIError.from_info(chunk.error).body())
                break
            event = self._chunk_event(chunk)
            if event is not None:
                yield event
            last = chunk
            chunk = await anext(rest, None)
        else:
            if self.include_usage:
                yield self._usage_event(last)
        yield "data: [DONE]\n\n"

    def _chunk_event(self, chunk: GenerationChunk) -> str | None:
        self.full_text += chunk.text
        if not chunk.text and chunk.finish_reason is None:
            return None  # text held back (partial UTF-8 or a possible stop string)
        content = self.full_text if self.full_text_enabled else chunk.text
        choice = ChunkChoice(
            index=0, delta=Delta(role="assistant", content=content), logprobs=None, finish_reason=chunk.finish_reason
        )
        if chunk.finish_reason is not None and chunk.stop_reason is not None:
            choice.stop_reason = chunk.stop_reason
        event = self._envelope([choice])
        if self.continuous_usage:
            event.usage = _usage(chunk)
        if self.full_text_enabled and chunk.finish_reason is not None:
            event.full_text = self.full_text
        return sse_json(event.dump_json())

    def _usage_event(self, last: GenerationChunk) -> str:
        event = self._envelope([])
        event.usage = _usage(last)
        return sse_json(event.dump_json())

    def _envelope(self, choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices
        )


def _usage(chunk: GenerationChunk) -> Usage:
    return Usage(
        prompt_tokens=chunk.prompt_tokens,
        completion_tokens=chunk.completion_tokens,
        total_tokens=chunk.prompt_tokens + chunk.completion_tokens,
    )


def sse(payload: dict) -> str:
    return sse_json(json.dumps(payload, ensure_ascii=False))


def sse_json(text: str) -> str:
    return f"data: {text}\n\n"
