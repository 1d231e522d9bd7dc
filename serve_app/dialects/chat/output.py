"""`/v1/chat/completions` output: worker chunks -> one `chat.completion`, or its SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.response import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    LogprobEntry,
    ToolCall,
    TopLogprobEntry,
)
from serve_app.http.errors import APIError
from serve_app.http.sse import json_text, sse, sse_json
from serve_app.output.call_deltas import CallAssembly, CallDelta, ParsedCall
from serve_app.output.choice_parser import ChunkReader, OutputParsing, ParsedDelta
from serve_app.schema.common import usage_of
from workers.contract.chunks import GenerationChunk, TokenLogprob, TopLogprob


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
    reasoning: list[str] = field(default_factory=list)
    calls: CallAssembly = field(default_factory=CallAssembly)
    reader: ChunkReader | None = None  # made on the choice's first chunk
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    role_sent: bool = False  # streaming: `role` goes in the choice's first delta only

    def take_role(self) -> bool:
        """Whether this delta is the choice's first (and so carries the role)."""
        first, self.role_sent = not self.role_sent, True
        return first

    def add_text(self, chunk: GenerationChunk, parsing: OutputParsing) -> ParsedDelta:
        """The chunk's text read by the choice's parsers (if any); the last chunk flushes them."""
        if self.reader is None:
            self.reader = ChunkReader(parsing)
        parsed = self.reader.read(chunk)
        self.texts.append(parsed.content)
        if parsed.reasoning:
            self.reasoning.append(parsed.reasoning)
        if parsed.calls:
            self.calls.add(parsed.calls)
        return parsed

    @property
    def reasoning_tokens(self) -> int:
        return self.reader.reasoning_tokens if self.reader else 0

    def message(self, parsing: OutputParsing) -> AssistantMessage:
        content = "".join(self.texts)
        message = AssistantMessage(role="assistant", content=content)
        if parsing.reasoning_parser is not None:
            message.reasoning_content = "".join(self.reasoning) or None
        if self.calls or parsing.forced_calls:  # an answer of calls: blank content is null
            message.content = content if content.strip() else None
        if self.calls:
            message.tool_calls = [tool_call(c) for c in self.calls.complete()]
        return message

    def final_reason(self) -> str | None:
        # OpenAI: a turn that ends (by the model) with calls ends with "tool_calls".
        return "tool_calls" if self.calls and self.finish_reason == "stop" else self.finish_reason


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, type="function", function=FunctionCall(name=call.name, arguments=call.arguments))


class CompletionAccumulator:
    """Folds worker chunks (of all n choices) into one non-streaming `chat.completion`."""

    def __init__(self, request_id: str, model: str, n: int = 1, parsing: OutputParsing = OutputParsing()) -> None:
        self.request_id = request_id
        self.model = model
        self.parsing = parsing
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
        state.add_text(chunk, self.parsing)
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
                message=s.message(self.parsing),
                logprobs=None if s.logprobs is None else logprob_entries(s.logprobs),
                finish_reason=s.final_reason(),
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
            usage=usage_of(self.last or GenerationChunk(), self._reasoning_tokens()),
            prefill_time=self.prefill_time,
            decode_time_arr=self.decode_times,
        )
        if self.prompt_logprobs is not None:
            response.prompt_logprobs = self.prompt_logprobs
        return response

    def _reasoning_tokens(self) -> int | None:
        if self.parsing.reasoning_parser is None:
            return None
        return sum(s.reasoning_tokens for s in self.choices)


class ChunkStreamer:
    """Turns worker chunks into `chat.completion.chunk` SSE events.

    With parsers in play (tools, reasoning), a chunk's text becomes `reasoning_content`,
    `content` and tool-call deltas: a call's first delta has its index, id, type, name and
    the arguments so far; later ones append to its arguments as the model writes them
    (serve_app/output/tool_parsers.py). `role` is in each choice's first delta only (with
    `full_text_enabled`, MindIE's shape, in every one)."""

    def __init__(self, request_id: str, req: ChatCompletionRequest, full_text_enabled: bool,
                 parsing: OutputParsing = OutputParsing()) -> None:
        self.request_id = request_id
        self.model = req.model
        self.created = int(time.time())
        options = req.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = bool(options and options.continuous_usage_stats)
        self.full_text_enabled = full_text_enabled
        self.full_texts = [""] * req.n
        self.parsing = parsing
        self.states = [_ChoiceState() for _ in range(req.n)]

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        """SSE lines; an error after the stream began is a last event before [DONE]. The
        common event (a choice's text, and its finish) is written from a template (the same
        JSON the models dump, a fraction of the cost); every other through the models."""
        plain = PlainEvents(self.request_id, self.created, self.model) if self._plain_stream() else None
        try:
            async for item in self._chunks(first, rest, plain is not None):
                if isinstance(item, ChatCompletionChunk):
                    yield sse_json(item.dump_json())
                elif item.text or item.finish_reason is not None:
                    yield sse_json(plain.content(item, self.states[item.index].take_role()))
        except APIError as exc:
            yield sse(exc.body())
        yield "data: [DONE]\n\n"

    def _plain_stream(self) -> bool:
        """Whether a chunk without logprobs can be written from the template: no parser reads
        the text, and no option adds fields to its event."""
        return not (self.parsing.active or self.full_text_enabled or self.continuous_usage)

    async def chunks(
        self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]
    ) -> AsyncIterator[ChatCompletionChunk]:
        """`chat.completion.chunk` objects (for SSE, or for Python callers of the handle API);
        a worker error raises APIError."""
        async for event in self._chunks(first, rest, plain=False):
            yield event

    async def _chunks(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk],
                      plain: bool) -> AsyncIterator[ChatCompletionChunk | GenerationChunk]:
        """The events, or with `plain` a worker chunk that is only text and a finish, as it is."""
        chunk: GenerationChunk | None = first
        last = first
        while chunk is not None:
            if chunk.error is not None:
                raise APIError.from_info(chunk.error)
            if plain and chunk.logprobs is None and chunk.prompt_logprobs is None:
                self.states[chunk.index].finish_reason = chunk.finish_reason
                yield chunk
            else:
                for event in self._chunk_events(chunk):
                    yield event
            last = chunk
            chunk = await anext(rest, None)
        if self.include_usage:
            yield self._usage_event(last)

    def _chunk_events(self, chunk: GenerationChunk) -> list[ChatCompletionChunk]:
        state = self.states[chunk.index]
        parsed = state.add_text(chunk, self.parsing)
        state.finish_reason = chunk.finish_reason
        self.full_texts[chunk.index] += parsed.content
        calls = [d for c in parsed.calls if (d := _call_delta(c)) is not None]
        has_news = parsed.content or parsed.reasoning or chunk.logprobs or chunk.prompt_logprobs \
            or (chunk.finish_reason is not None and not calls)  # else the finish rides on the last call
        if not has_news and not calls:
            return []  # text held back (partial UTF-8, a possible stop string or tag)
        content = self.full_texts[chunk.index] if self.full_text_enabled else parsed.content
        delta = Delta()
        if content or not parsed.reasoning:
            delta.content = content
        if parsed.reasoning:
            delta.reasoning_content = parsed.reasoning
        deltas = ([delta] if has_news else []) + calls
        # OpenAI's stream names the role once; MindIE's (fullTextEnabled, seed 000) in every delta.
        if state.take_role() or self.full_text_enabled:
            deltas[0].role = "assistant"
        events = [self._event(chunk, d) for d in deltas]
        self._decorate_first(events[0], chunk)
        self._decorate_last(events[-1], chunk, state)
        return events

    def _event(self, chunk: GenerationChunk, delta: Delta) -> ChatCompletionChunk:
        return self._envelope([ChunkChoice(index=chunk.index, delta=delta, logprobs=None, finish_reason=None)])

    def _decorate_first(self, event: ChatCompletionChunk, chunk: GenerationChunk) -> None:
        if chunk.logprobs is not None:
            event.choices[0].logprobs = logprob_entries(chunk.logprobs)
        if chunk.prompt_logprobs is not None:
            event.prompt_logprobs = prompt_logprob_entries(chunk.prompt_logprobs)

    def _decorate_last(self, event: ChatCompletionChunk, chunk: GenerationChunk, state: _ChoiceState) -> None:
        choice = event.choices[0]
        if chunk.finish_reason is not None:
            choice.finish_reason = state.final_reason()
            if chunk.stop_reason is not None:
                choice.stop_reason = chunk.stop_reason
        if self.continuous_usage:
            event.usage = usage_of(chunk, self._reasoning_tokens())
        if self.full_text_enabled and chunk.finish_reason is not None:
            # MindIE's fullTextEnabled stream (seeds 000/001): the last chunk adds full_text and usage.
            event.full_text = self.full_texts[chunk.index]
            event.usage = usage_of(chunk, self._reasoning_tokens())

    def _reasoning_tokens(self) -> int | None:
        if self.parsing.reasoning_parser is None:
            return None
        return sum(s.reasoning_tokens for s in self.states)

    def _usage_event(self, last: GenerationChunk) -> ChatCompletionChunk:
        event = self._envelope([])
        event.usage = usage_of(last, self._reasoning_tokens())
        return event

    def _envelope(self, choices: list[ChunkChoice]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.request_id, object="chat.completion.chunk", created=self.created, model=self.model, choices=choices
        )


class PlainEvents:
    """The JSON of a `chat.completion.chunk` that carries one choice's text (and maybe its
    finish), built from a template: the same text `ChatCompletionChunk.dump_json` writes
    (tests/unit/api/test_chat_events.py holds them equal), without building the models."""

    def __init__(self, request_id: str, created: int, model: str) -> None:
        self._head = (f'{{"id":{json_text(request_id)},"object":"chat.completion.chunk","created":{created},'
                      f'"model":{json_text(model)},"choices":[{{"index":')

    def content(self, chunk: GenerationChunk, role: bool) -> str:
        """`role`: the choice's first delta, which carries the role."""
        finish = "null" if chunk.finish_reason is None else json_text(chunk.finish_reason)
        delta = '{"role":"assistant","content":' if role else '{"content":'
        event = (f'{self._head}{chunk.index},"delta":{delta}{json_text(chunk.text)}}},'
                 f'"logprobs":null,"finish_reason":{finish}')
        if chunk.finish_reason is not None and chunk.stop_reason is not None:
            event += f',"stop_reason":{json_text(chunk.stop_reason)}'
        return event + "}]}"


def _call_delta(call: CallDelta) -> Delta | None:
    """OpenAI's shape: a call's first delta has its index, id, type, name and (maybe empty)
    arguments; later ones its index and arguments to append. None: nothing to send (the
    call's end)."""
    if call.id is not None:
        head = DeltaToolCall(index=call.index, id=call.id, type="function",
                             function=DeltaFunctionCall(name=call.name, arguments=call.arguments))
        return Delta(tool_calls=[head])
    if call.arguments:
        return Delta(tool_calls=[DeltaToolCall(index=call.index, function=DeltaFunctionCall(arguments=call.arguments))])
    return None


