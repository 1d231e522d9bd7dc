"""`/v1/messages` output: worker chunks -> content blocks (thinking, text, tool_use), as one
`message` object or as the stream's events.

A chunk's text goes through the chat path's choice parser (reasoning, then tool calls);
what it yields opens, extends and closes content blocks in the order the model wrote them:
a change of kind closes the open block, so the streamed blocks and the whole message are
the same list. Whitespace-only text (between or before calls) opens no text block; it is
kept only when the answer has no calls. A tool_use block opens once its function is known
and its input streams as `input_json_delta`s of the JSON the model writes; a call the
output cut off is not part of the message: in a stream, where it was already announced,
its block is closed as it stands.

The stream: `message_start` (the prompt's usage), the blocks' `content_block_start`,
`content_block_delta` (text_delta, thinking_delta, input_json_delta) and
`content_block_stop`, then `message_delta` (stop_reason, stop_sequence, usage) and
`message_stop`; a worker error after the start is an `error` event, and the stream ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from serve_app.dialects.messages.request import MessagesRequest
from serve_app.dialects.messages.response import (
    ContentOut,
    MessageOut,
    MessagesUsage,
    StopReason,
    TextOut,
    ThinkingOut,
    ToolUseOut,
    error_body,
)
from serve_app.dialects.messages.translate import WORKER_PARAM_NAMES
from serve_app.http.errors import APIError
from serve_app.http.sse import json_text, sse_json
from serve_app.output.call_deltas import CallDelta
from serve_app.output.choice_parser import ChunkReader, OutputParsing, ParsedDelta
from workers.contract.chunks import GenerationChunk
from workers.contract.json_text import loads_json_text

Event = dict[str, Any]
_DELTA = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
          "tool_use": ("input_json_delta", "partial_json")}


@dataclass
class _OpenBlock:
    kind: Literal["text", "thinking", "tool_use"]
    index: int
    parts: list[str] = field(default_factory=list)
    call_id: str = ""
    name: str = ""

    def start(self) -> Event:
        empty: dict[str, Any] = {"text": {"type": "text", "text": ""},
                                 "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                                 "tool_use": {"type": "tool_use", "id": self.call_id, "name": self.name,
                                              "input": {}}}[self.kind]
        return {"type": "content_block_start", "index": self.index, "content_block": empty}

    def delta(self, text: str) -> Event:
        self.parts.append(text)
        kind, key = _DELTA[self.kind]
        return {"type": "content_block_delta", "index": self.index, "delta": {"type": kind, key: text}}

    def block(self) -> ContentOut | None:
        """The closed block; None for a call whose input is not a JSON object."""
        text = "".join(self.parts)
        if self.kind == "text":
            return TextOut(text=text)
        if self.kind == "thinking":
            return ThinkingOut(thinking=text)
        try:
            arguments = loads_json_text(text or "{}")
        except ValueError:
            return None
        return ToolUseOut(id=self.call_id, name=self.name, input=arguments) if isinstance(arguments, dict) else None


class ContentBlocks:
    """The content blocks of one answer, and the events each piece of parsed output makes."""

    def __init__(self) -> None:
        self.done: list[ContentOut] = []
        self.calls = 0
        self._open: _OpenBlock | None = None
        self._spaces = ""  # whitespace-only text that has opened no block yet
        self._started = 0  # blocks announced (the next block's index)

    def add(self, parsed: ParsedDelta) -> list[Event]:
        events: list[Event] = []
        if parsed.reasoning:
            events += self._text("thinking", parsed.reasoning)
        if parsed.content:
            events += self._content(parsed.content)
        for piece in parsed.calls:
            events += self._call_piece(piece)
        return events

    def finish(self) -> list[Event]:
        """The open block closed (a cut call dropped from the message); an answer that wrote
        nothing visible but whitespace, and no calls, keeps it as its text."""
        if self._open is not None and self._open.kind == "tool_use":
            return self._close(keep=False)
        if self.calls == 0 and self._spaces:
            return self._content("", force=True) + self._close()
        return self._close()

    def _content(self, text: str, force: bool = False) -> list[Event]:
        if self._open is not None and self._open.kind == "text":
            return self._text("text", text)
        self._spaces += text
        if not force and not self._spaces.strip():
            return []
        text, self._spaces = self._spaces, ""
        return self._text("text", text)

    def _text(self, kind: Literal["text", "thinking"], text: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events.append(self._start(_OpenBlock(kind, self._started)))
        if text:
            events.append(self._open.delta(text))
        return events

    def _call_piece(self, piece: CallDelta) -> list[Event]:
        events: list[Event] = []
        if piece.id is not None:  # a new call: its function is known
            self._spaces = ""  # whitespace around calls is not an answer
            keep_cut = self._open is None or self._open.kind != "tool_use"
            events += self._close(keep=keep_cut)
            events.append(self._start(_OpenBlock("tool_use", self._started, call_id=piece.id, name=piece.name or "")))
        if self._open is None or self._open.kind != "tool_use":
            return events
        if piece.arguments:
            events.append(self._open.delta(piece.arguments))
        if piece.done:
            self.calls += 1
            events += self._close()
        return events

    def _start(self, block: _OpenBlock) -> Event:
        self._open = block
        self._started += 1
        return block.start()

    def _close(self, keep: bool = True) -> list[Event]:
        """The open block's stop event; `keep`: it is part of the message (a cut call is not)."""
        block, self._open = self._open, None
        if block is None:
            return []
        if keep and (done := block.block()) is not None:
            self.done.append(done)
        return [{"type": "content_block_stop", "index": block.index}]


class MessageBuilder:
    """One request's answer: worker chunks in, events and the `message` object out."""

    def __init__(self, message_id: str, req: MessagesRequest, parsing: OutputParsing) -> None:
        self.id = message_id
        self.req = req
        self.parsing = parsing
        self.blocks = ContentBlocks()
        self._reader = ChunkReader(parsing)
        self._last = GenerationChunk()
        self._finish: GenerationChunk | None = None

    def add(self, chunk: GenerationChunk) -> list[Event]:
        """The events of one worker chunk; a worker error raises APIError."""
        if chunk.error is not None:
            raise APIError.from_info(chunk.error, WORKER_PARAM_NAMES)
        events = self.blocks.add(self._reader.read(chunk))
        if chunk.finish_reason is not None:
            self._finish = chunk
            events += self.blocks.finish()
        self._last = chunk
        return events


    def stop_reason(self) -> tuple[StopReason | None, str | None]:
        """(stop_reason, stop_sequence): a cap first, then calls, then a stop sequence."""
        finish = self._finish
        if finish is None:
            return None, None
        if finish.finish_reason == "length":
            return "max_tokens", None
        if self.blocks.calls:
            return "tool_use", None
        if isinstance(finish.stop_reason, str):
            return "stop_sequence", finish.stop_reason
        return "end_turn", None

    def usage(self) -> MessagesUsage:
        last = self._last
        return MessagesUsage(input_tokens=last.prompt_tokens, output_tokens=last.completion_tokens,
                             cache_read_input_tokens=last.cached_tokens or 0)

    def message(self, content: list[ContentOut] | None = None) -> MessageOut:
        """The message so far (`content` given: as `message_start` shows it)."""
        stop_reason, stop_sequence = self.stop_reason()
        return MessageOut(id=self.id, model=self.req.model,
                          content=list(self.blocks.done) if content is None else content,
                          stop_reason=stop_reason, stop_sequence=stop_sequence, usage=self.usage())


class MessageAccumulator:
    """Folds the worker's chunks into one `message`."""

    def __init__(self, builder: MessageBuilder) -> None:
        self.builder = builder

    def add(self, chunk: GenerationChunk) -> None:
        self.builder.add(chunk)

    def result(self) -> MessageOut:
        return self.builder.message()


class MessageStreamer:
    """The stream's events, each as `event:` and `data:` lines (see the module docstring)."""

    def __init__(self, builder: MessageBuilder) -> None:
        self.builder = builder

    async def events(self, first: GenerationChunk, rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[str]:
        builder = self.builder
        try:
            chunk: GenerationChunk | None = first
            started = False
            while chunk is not None:
                events = builder.add(chunk)
                if not started:  # after the first chunk: it carries the prompt's usage
                    started = True
                    yield _sse({"type": "message_start", "message": builder.message(content=[]).dump()
                                | {"stop_reason": None, "stop_sequence": None}})
                for event in events:
                    yield _sse(event)
                chunk = await anext(rest, None)
        except APIError as exc:
            yield _sse(error_body(exc))
            return
        stop_reason, stop_sequence = builder.stop_reason()
        usage = builder.usage().dump()
        yield _sse({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                    "usage": usage})
        yield _sse({"type": "message_stop"})


def _sse(event: Event) -> str:
    return f"event: {event['type']}\n" + sse_json(json_text(event))
