"""gpt-oss's harmony output read as it streams: reasoning (`reasoning_parser: openai_gptoss`)
and tool calls (`tool_call_parser: openai`), vLLM's names for both.

The chat template ends the prompt with `<|start|>assistant`; the model then writes messages,
each a header and a body:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>

    <|channel|>final<|message|>It is sunny.<|return|>

The `analysis` channel is reasoning, `final` (and `commentary` with no recipient: a
preamble) is the answer, and a message addressed `to=functions.NAME` (in the header after
the channel, or after the role) is a call whose body is its arguments object. `<|call|>`
and `<|return|>` end a turn (the model's stop tokens: the worker may leave them out of the
text); an output cut inside a body ends that message there.

The reasoning parser passes calls on in one spelling,
`<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`, as content for the tool
parser, which reads that and raw harmony alike: the tool parser alone (a model configured
without the reasoning parser) gives the analysis as content, as every format does without
its reasoning parser. The tags are special tokens of gpt-oss's tokenizer: with either
parser the output is decoded with `skip_special_tokens` false.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import new_call_id
from serve_app.output.reasoning import ReasoningOutput
from serve_app.output.tags import held_prefix
from serve_app.output.tool_parser_base import (
    ArgumentsText,
    ToolOutput,
    ToolParser,
    arguments_json,
    function_alternatives,
    grammar_functions,
    lit,
    tagged_calls_grammar,
    tool_list,
)
from serve_app.schema.tools import Tool
from workers.contract.requests import ToolPrompt

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
FUNCTIONS = "functions."
CALL_OPEN = f"{CHANNEL}commentary to={FUNCTIONS}"  # the one spelling of a call's header passed on
_HEADER_OPENS = (START, CHANNEL)
_BODY_ENDS = (END, CALL, RETURN)
_HEADER_LIMIT = 256  # a header is short: longer, the text was no header
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(frozen=True)
class Header:
    channel: str
    recipient: str | None

    @property
    def function(self) -> str | None:
        """The function a call is addressed to (`to=functions.NAME`), else None."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):]


@dataclass(frozen=True)
class Event:
    """A piece of harmony text: `text` outside any message, a `header` decided, a `body`
    piece, or the `end` of a message."""

    kind: str  # "text" | "header" | "body" | "end"
    text: str = ""
    header: Header | None = None


def _held(text: str, tags: tuple[str, ...]) -> int:
    return max(held_prefix(text, tag) for tag in tags)


def _first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    found = [(text.find(tag), tag) for tag in tags if tag in text]
    return min(found) if found else (-1, None)


class HarmonySplitter:
    """Harmony text, pushed in pieces, as `Event`s; text that may begin a tag is held back."""

    def __init__(self, header: Header | None = None) -> None:
        """`header`: the output begins inside a body with this header (the prompt opened it)."""
        self._state = "body" if header is not None else "outside"
        self._buffer = ""
        self._header_text = ""

    @property
    def in_header(self) -> bool:
        """Whether a header is being read (its message's kind not yet known)."""
        return self._state == "header"

    def push(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while getattr(self, "_" + self._state)(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events = self.push("")
        rest, self._buffer = self._buffer, ""
        if self._state == "header":  # never closed: it was text
            rest, self._header_text = self._header_text + rest, ""
            self._state = "outside"
        if rest:
            events.append(Event(self._state if self._state == "body" else "text", rest))
        if self._state == "body":
            events.append(Event("end"))
        self._state = "outside"
        return events

    def _outside(self, events: list[Event]) -> bool:
        tag = self._emit_until(events, "text", _HEADER_OPENS)
        if tag is None:
            return False
        # the opening tag stays in the header's text: the text again if it is no header
        self._header_text, self._buffer, self._state = tag, self._buffer[len(tag):], "header"
        return True

    def _header(self, events: list[Event]) -> bool:
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if len(self._header_text) + len(self._buffer) > _HEADER_LIMIT:
                self._emit(events, "text", self._header_text)
                self._state, self._header_text = "outside", ""
                return True
            return False
        text = self._header_text + self._buffer[:at]
        channel = _CHANNEL_NAME.search(text)
        recipient = _RECIPIENT.search(text)
        events.append(Event("header", header=Header(channel.group(1) if channel else "", recipient and recipient.group(1))))
        self._buffer, self._state, self._header_text = self._buffer[at + len(MESSAGE):], "body", ""
        return True

    def _body(self, events: list[Event]) -> bool:
        tag = self._emit_until(events, "body", _BODY_ENDS)
        if tag is None:
            return False
        events.append(Event("end", tag))
        self._buffer, self._state = self._buffer[len(tag):], "outside"
        return True

    def _emit_until(self, events: list[Event], kind: str, tags: tuple[str, ...]) -> str | None:
        """Emit the buffer as `kind` up to the first of `tags`, which then begins the buffer
        (returned); with none in it, all but what may begin one (None)."""
        at, tag = _first(self._buffer, tags)
        end = at if tag is not None else len(self._buffer) - _held(self._buffer, tags)
        self._emit(events, kind, self._buffer[:end])
        self._buffer = self._buffer[end:]
        return tag

    @staticmethod
    def _emit(events: list[Event], kind: str, text: str) -> None:
        if text:
            events.append(Event(kind, text))


class GptOssReasoningParser:
    """The analysis channel as reasoning; the answer's text as content; calls passed on as
    content in the spelling the tool parser reads. The interface of reasoning.py's parsers."""

    START, END = f"{CHANNEL}analysis{MESSAGE}", END
    special_tags = True  # the channel tags are special tokens: decode with them

    def __init__(self, reasoning_open: bool = False) -> None:
        self._split = HarmonySplitter(Header("analysis", None) if reasoning_open else None)
        self._mode = "reasoning" if reasoning_open else None  # the open message: reasoning | content | call
        self._pending_tokens = 0  # tokens of a header not yet decided
        self.reasoning_tokens = 0

    def push(self, text: str, num_tokens: int = 0) -> ReasoningOutput:
        return self._read(self._split.push(text), num_tokens)

    def finish(self) -> ReasoningOutput:
        return self._read(self._split.finish(), 0)

    def _read(self, events: list[Event], num_tokens: int) -> ReasoningOutput:
        out, touched = ReasoningOutput(), self._mode == "reasoning"
        for event in events:
            if event.kind == "header":
                function = event.header.function
                self._mode = "reasoning" if event.header.channel == "analysis" else "call" if function else "content"
                if function:
                    out.content += CALL_OPEN + function + MESSAGE
            elif event.kind == "end":
                if self._mode == "call":
                    out.content += CALL
                self._mode = None
            elif event.kind == "body" and self._mode == "reasoning":
                out.reasoning += event.text
            else:
                out.content += event.text
            touched = touched or self._mode == "reasoning"
        self._count(touched, num_tokens)
        return out

    def _count(self, touched: bool, num_tokens: int) -> None:
        """A chunk's tokens are reasoning when any part of it was the analysis message (its
        header's tokens wait until the header is decided)."""
        if self._split.in_header and not touched:
            self._pending_tokens += num_tokens
            return
        tokens, self._pending_tokens = self._pending_tokens + num_tokens, 0
        if touched:
            self.reasoning_tokens += tokens


class HarmonyToolParser(ToolParser):
    """Calls: messages addressed to a declared function, the body its arguments object,
    announced once the header names the function and streamed as written; whole when the
    object closes. Bodies of other messages are content; a call to an undeclared function
    is content (its body); a body that is no object, or one cut off, is neither."""

    name = "openai"
    special_tags = True

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self._split = HarmonySplitter()
        self._call: ArgumentsText | None = None  # the arguments being read
        self._index = -1
        self._function: str | None = None  # the open message calls this declared function (None: its body is content)
        self._skip = False  # the rest of this body is neither content nor a call

    def push(self, text: str) -> ToolOutput:
        return self._read(self._split.push(text))

    def finish(self) -> ToolOutput:
        return self._read(self._split.finish())

    def _read(self, events: list[Event]) -> ToolOutput:
        out = ToolOutput()
        for event in events:
            if event.kind == "header":  # an undeclared function's body is content, as a message's
                self._function = event.header.function if event.header.function in self.names else None
            elif event.kind == "end":
                self._function, self._call, self._skip = None, None, False
            elif event.kind == "body" and self._function:
                self._arguments(event.text, out)
            else:
                out.content += event.text
        return self._checked(out)

    def _arguments(self, text: str, out: ToolOutput) -> None:
        if self._skip:
            return
        if self._call is None:
            text = text.lstrip()
            if not text:
                return
            if not text.startswith("{"):
                self._skip = True
                return
            self._call, self._index = ArgumentsText(), self._next_index()
            out.calls.append(CallDelta(self._index, self._call.push(text), new_call_id(), self._function))
        else:
            piece = self._call.push(text)
            if piece:
                out.calls.append(CallDelta(self._index, piece))
        if self._call.rest is not None:
            out.calls.append(CallDelta(self._index, done=True))
            self._skip = True

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        """One call (a call ends the model's turn: `<|call|>` is its stop token)."""
        picked = grammar_functions(tools, choice)
        if picked is None:
            return None
        functions, bind_all = picked
        rules = [
            f"calls: {function_alternatives(functions)}",
            *(f"fn_{i}: {lit(f.name + MESSAGE)} {arguments_json(f, bind_all or bool(f.strict))}"
              for i, f in enumerate(functions)),
        ]
        return tagged_calls_grammar(CALL_OPEN, rules, bind_all)

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "# Tools\nYou have access to the following functions:\n"
            f"{tool_list(tools)}\n\n"
            f"To call a function, reply with: {CALL_OPEN}<function-name> <|constrain|>json{MESSAGE}"
            f"<args-json-object>{CALL}"
        )
        # Earlier calls can only be written as JSON objects (ToolPrompt's one call shape).
        return ToolPrompt(section, f"{CHANNEL}commentary{MESSAGE}", CALL, "arguments",
                          f"{START}functions to=assistant{CHANNEL}commentary{MESSAGE}", END)
