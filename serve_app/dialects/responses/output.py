"""`/v1/responses` output: worker chunks -> output items (reasoning, messages, function
calls), as one `response` object or as the stream's typed events.

A chunk's text goes through the chat path's choice parser (reasoning, then tool calls);
what it yields opens, extends and closes output items in the order the model wrote them:
a change of kind closes the open item, so the streamed items and the whole response are
the same list. Whitespace-only text (between or before calls) opens no message; it is
kept only when the answer has no calls. A function call item opens once its function is
known and its arguments stream as the model writes them (the parser's pieces); a call the
output cut off is neither text nor part of the response's output: in a stream, where it
was already announced, its item is closed `incomplete`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.dialects.responses.request import ResponsesRequest
from serve_app.dialects.responses.response import (
    FunctionCallOutput,
    IncompleteDetails,
    InputTokensDetails,
    MessageOutput,
    OutputItem,
    OutputTextPart,
    OutputTokensDetails,
    ReasoningOutput,
    ReasoningTextPart,
    Response,
    ResponseError,
    ResponseUsage,
)
from serve_app.dialects.responses.translate import WORKER_PARAM_NAMES
from serve_app.http.errors import APIError
from serve_app.http.sse import json_text, sse_json
from serve_app.output.call_deltas import CallDelta
from serve_app.output.choice_parser import ChunkReader, OutputParsing, ParsedDelta
from workers.contract.chunks import GenerationChunk

Event = dict[str, Any]  # one typed event, without its sequence_number


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class _OpenText:
    """The text item being written: a reasoning item or a message (one content part)."""

    kind: Literal["reasoning", "message"]
    id: str
    output_index: int
    texts: list[str] = field(default_factory=list)

    def item(self, status: str) -> OutputItem:
        """The item: in progress (as announced, before its part) or closed (with its part)."""
        parts = [] if status == "in_progress" else [self.part()]
        if self.kind == "reasoning":
            return ReasoningOutput(id=self.id, status=status, content=parts)
        return MessageOutput(id=self.id, status=status, content=parts)

    def part(self) -> ReasoningTextPart | OutputTextPart:
        text = "".join(self.texts)
        return ReasoningTextPart(text=text) if self.kind == "reasoning" else OutputTextPart(text=text)


@dataclass
class _OpenCall:
    """The function call being written: announced, its arguments streaming."""

    item: FunctionCallOutput
    output_index: int
    parts: list[str] = field(default_factory=list)

    def where(self) -> dict[str, Any]:
        return {"item_id": self.item.id, "output_index": self.output_index}


class OutputItems:
    """The output items of one answer, and the events each piece of parsed output makes."""

    def __init__(self) -> None:
        self.done: list[OutputItem] = []
        self._open: _OpenText | None = None
        self._spaces = ""  # whitespace-only content that has opened no message yet
        self._calls = 0
        self._call: _OpenCall | None = None  # calls are written one after another: one is open at most

    def add(self, parsed: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
        if parsed.content:
            events += self._content(parsed.content)
        for piece in parsed.calls:
            events += self._call_piece(piece)
        return events

    def finish(self, status: str) -> list[Event]:
        """The last item closed with `status`; an answer that wrote nothing visible (or only
        whitespace, and no calls) still has a message."""
        events = self._drop_cut_call()
        if self._calls == 0 and (self._spaces or not self.done and self._open is None):
            events += self._content("", force=True)
        return events + self._close(status)

    def _content(self, text: str, force: bool = False) -> list[Event]:
        if self._open is not None and self._open.kind == "message":
            return self._text("message", text)
        self._spaces += text
        if not force and not self._spaces.strip():
            return []
        text, self._spaces = self._spaces, ""
        return self._text("message", text)

    def _text(self, kind: Literal["reasoning", "message"], text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close("completed")
            events += self._open_text(kind)
        item = self._open
        item.texts.append(text)
        if text:
            kind_name = "reasoning_text" if kind == "reasoning" else "output_text"
            extra = {} if kind == "reasoning" else {"logprobs": []}
            events.append({"type": f"response.{kind_name}.delta", "item_id": item.id,
                           "output_index": item.output_index, "content_index": 0, "delta": text, **extra})
        return events

    def _open_text(self, kind: Literal["reasoning", "message"]) -> list[Event]:
        item = _OpenText(kind, _item_id("rs" if kind == "reasoning" else "msg"), len(self.done))
        self._open = item
        empty = ReasoningTextPart(text="") if kind == "reasoning" else OutputTextPart(text="")
        return [
            {"type": "response.output_item.added", "output_index": item.output_index,
             "item": item.item("in_progress").dump()},
            {"type": "response.content_part.added", "item_id": item.id, "output_index": item.output_index,
             "content_index": 0, "part": empty.dump()},
        ]

    def _close(self, status: str) -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        done = item.item(status)
        self.done.append(done)
        where = {"item_id": item.id, "output_index": item.output_index, "content_index": 0}
        kind_name = "reasoning_text" if item.kind == "reasoning" else "output_text"
        extra = {} if item.kind == "reasoning" else {"logprobs": []}
        return [
            {"type": f"response.{kind_name}.done", **where, "text": "".join(item.texts), **extra},
            {"type": "response.content_part.done", **where, "part": item.part().dump()},
            {"type": "response.output_item.done", "output_index": item.output_index, "item": done.dump()},
        ]

    def _call_piece(self, piece: CallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None:  # a new call: its function is known
            self._spaces = ""  # whitespace around calls is not an answer
            events += self._close("completed") + self._drop_cut_call()
            item = FunctionCallOutput(id=_item_id("fc"), call_id=piece.id, name=piece.name or "", arguments="",
                                      status="in_progress")
            self._call = _OpenCall(item, len(self.done))
            events.append({"type": "response.output_item.added", "output_index": len(self.done),
                           "item": item.dump()})
        call = self._call
        if call is None:
            return events
        if piece.arguments:
            call.parts.append(piece.arguments)
            events.append({"type": "response.function_call_arguments.delta", **call.where(),
                           "delta": piece.arguments})
        if piece.done:
            events += self._finish_call(call)
        return events

    def _finish_call(self, call: _OpenCall) -> list[Event]:
        self._call, self._calls = None, self._calls + 1
        call.item.arguments, call.item.status = "".join(call.parts), "completed"
        self.done.append(call.item)
        return [{"type": "response.function_call_arguments.done", **call.where(), "name": call.item.name,
                 "arguments": call.item.arguments},
                {"type": "response.output_item.done", "output_index": call.output_index, "item": call.item.dump()}]

    def _drop_cut_call(self) -> list[Event]:
        """A call the output ended inside is not part of the answer; a stream that announced
        it closes its item as incomplete."""
        call, self._call = self._call, None
        if call is None:
            return []
        call.item.arguments, call.item.status = "".join(call.parts), "incomplete"
        return [{"type": "response.output_item.done", "output_index": call.output_index, "item": call.item.dump()}]


class ResponseBuilder:
    """One request's answer: worker chunks in, events and the `response` object out."""

    def __init__(self, response_id: str, req: ResponsesRequest, parsing: OutputParsing,
                 store: bool = False) -> None:
        self.id = response_id
        self.req = req
        self.parsing = parsing
        self.store = store
        self.created_at = int(time.time())
        self.items = OutputItems()
        self._reader = ChunkReader(parsing)
        self._last: GenerationChunk | None = None
        self._finish: str | None = None

    def add(self, chunk: GenerationChunk) -> list[Event]:
        """The events of one worker chunk; a worker error raises APIError."""
        if chunk.error is not None:
            raise APIError.from_info(chunk.error, WORKER_PARAM_NAMES)
        events = self.items.add(self._reader.read(chunk))
        if chunk.finish_reason is not None:
            self._finish = chunk.finish_reason
            events += self.items.finish("incomplete" if chunk.finish_reason == "length" else "completed")
        self._last = chunk
        return events


    def response(self, status: str | None = None, error: APIError | None = None) -> Response:
        """The response so far: `status` given (in_progress, failed), else as the finish says."""
        if status is None:
            status = "incomplete" if self._finish == "length" else "completed"
        req = self.req
        return Response(
            id=self.id,
            created_at=self.created_at,
            status=status,
            error=None if error is None else ResponseError(code=_error_code(error), message=error.message),
            incomplete_details=IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None,
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=req.model,
            output=list(self.items.done) if status != "in_progress" else [],
            parallel_tool_calls=req.parallel_tool_calls,
            previous_response_id=req.previous_response_id,
            store=self.store,
            temperature=1.0 if req.temperature is None else req.temperature,
            text={"format": (req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text
                             else {"type": "text"})},
            tool_choice=_tool_choice(req),
            tools=[{"type": "function", **t.model_dump(exclude={"type"})} for t in req.tools or []],
            top_p=1.0 if req.top_p is None else req.top_p,
            usage=self._usage() if status in ("completed", "incomplete") else None,
            user=req.user,
            metadata=dict(req.metadata or {}),
        )

    def _usage(self) -> ResponseUsage:
        last = self._last or GenerationChunk()
        return ResponseUsage(
            input_tokens=last.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=last.cached_tokens or 0),
            output_tokens=last.completion_tokens,
            output_tokens_details=OutputTokensDetails(
                reasoning_tokens=self._reader.reasoning_tokens),
            total_tokens=last.prompt_tokens + last.completion_tokens,
        )


def _tool_choice(req: ResponsesRequest) -> str | dict:
    if req.tool_choice is None:
        return "auto" if req.tools else "none"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def _error_code(error: APIError) -> str:
    """The response's error code is one of OpenAI's few; the `error` event before it has the exact one."""
    return "server_error" if error.status >= 500 else "invalid_prompt"


Saver = Callable[[Response], None]


class ResponseAccumulator:
    """Folds the worker's chunks into one `response` (saved by `save`, if given)."""

    def __init__(self, builder: ResponseBuilder, save: Saver | None = None) -> None:
        self.builder = builder
        self.save = save

    def add(self, chunk: GenerationChunk) -> None:
        self.builder.add(chunk)

    def result(self) -> Response:
        response = self.builder.response()
        if self.save is not None:
            self.save(response)
        return response


class ResponseStreamer:
    """The stream's typed events, each as `event:` and `data:` lines with its
    `sequence_number`: created, in_progress, the items' events, then completed or
    incomplete; a worker error after the start is an `error` event, then `response.failed`."""

    def __init__(self, builder: ResponseBuilder, save: Saver | None = None) -> None:
        self.builder = builder
        self.save = save
        self._sequence = 0

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        builder = self.builder
        started = builder.response("in_progress").dump()
        yield self._sse({"type": "response.created", "response": started})
        yield self._sse({"type": "response.in_progress", "response": started})
        try:
            chunk: GenerationChunk | None = first
            while chunk is not None:
                for event in builder.add(chunk):
                    yield self._sse(event)
                chunk = await anext(rest, None)
        except APIError as exc:
            yield self._sse({"type": "error", "code": exc.code or exc.type, "message": exc.message,
                             "param": exc.param})
            yield self._sse({"type": "response.failed", "response": builder.response("failed", exc).dump()})
            return
        response = builder.response()
        if self.save is not None:
            self.save(response)
        kind = "response.incomplete" if response.status == "incomplete" else "response.completed"
        yield self._sse({"type": kind, "response": response.dump()})

    def _sse(self, event: Event) -> str:
        event["sequence_number"] = self._sequence
        self._sequence += 1
        return f"event: {event['type']}\n" + sse_json(json_text(event))
