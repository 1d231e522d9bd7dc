"""DeepSeek V3's tool calls (`tool_call_parser: deepseek_v3`; R1-0528 writes them too):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1's shorter call, `<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>`,
is read too. Text before the calls is content. A call is announced once its name is known
and its arguments stream as written; it is whole when they close. Markup that is not a
call, found before a call was announced, is content; a broken call after one is skipped
to its end tag.

The tags are special tokens of DeepSeek's tokenizer: the parser sees them only when the
output is decoded with `skip_special_tokens` false. The grammar (V3's spelling) writes
them as text, which a model may spell with ordinary tokens.
"""

from __future__ import annotations

import re
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import new_call_id
from serve_app.output.tool_parser_base import (
    ArgumentsText,
    BodyStep,
    CallsBody,
    Head,
    TaggedToolParser,
    arguments_json,
    expect,
    find_first,
    function_alternatives,
    grammar_functions,
    lit,
    repeats,
    tagged_calls_grammar,
    tool_list,
)
from serve_app.schema.tools import Tool
from workers.contract.requests import ToolPrompt

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# A call's head up to the brace that opens its arguments: V3's (type, sep, name, fence),
# or V3.1's (name, sep).
_HEAD = re.compile(r"\s*(?:\w+" + SEP + r"([A-Za-z0-9_-]{1,64})\s*```json\s*|([A-Za-z0-9_-]{1,64})" + SEP + r"\s*)\{")


class _DeepSeekBody(CallsBody):
    """What follows `<｜tool▁calls▁begin｜>`: calls, up to `<｜tool▁calls▁end｜>`."""

    def __init__(self, parser: DeepSeekV3ToolParser) -> None:
        self._parser = parser
        self._state = "between"  # between -> head -> arguments -> tail -> between
        self._buffer = ""
        self._raw = ""  # everything read while nothing was announced (given back if no call)
        self._announced = False
        self._call_head = Head(_HEAD, "{")
        self._args = ArgumentsText()
        self._index = -1

    def push(self, text: str) -> BodyStep:
        if not self._announced:
            self._raw += text
        step = BodyStep()
        rest: str | None = text
        while rest is not None and step.rest is None and step.rejected is None:
            rest = getattr(self, "_" + self._state)(rest, step)
        return step

    def _not_calls(self, text: str, step: BodyStep) -> None:
        """Markup that is not a call: before any call, all of it is text; after one,
        this call is skipped up to its end tag."""
        if not self._announced:
            step.rejected = self._raw
        else:
            self._state, self._buffer = "tail", text

    def _between(self, text: str, step: BodyStep) -> str | None:
        self._buffer += text
        tag, possible = expect(self._buffer, (CALL_BEGIN, CALLS_END))
        head = self._buffer.lstrip()
        if tag == CALL_BEGIN:
            self._state, self._buffer, self._call_head = "head", "", Head(_HEAD, "{")
            return head[len(CALL_BEGIN):]
        if tag == CALLS_END:
            step.rest = head[len(CALLS_END):]
        elif not possible:
            if self._announced:
                step.rest = head  # the calls are over without their end tag: text follows
            else:
                step.rejected = self._raw
        return None

    def _head(self, text: str, step: BodyStep) -> str | None:
        if not self._call_head.push(text):
            return None
        match = self._call_head.match
        name = (match.group(1) or match.group(2)) if match else None
        if name not in self._parser.names:
            self._not_calls(self._call_head.rest if match else self._call_head.text + self._call_head.rest, step)
            return None
        self._state, self._announced = "arguments", True
        self._index, self._args = self._parser._next_index(), ArgumentsText()
        piece = self._args.push("{" + self._call_head.rest)
        step.calls.append(CallDelta(self._index, piece, new_call_id(), name))
        return self._closed(step)

    def _arguments(self, text: str, step: BodyStep) -> str | None:
        piece = self._args.push(text)
        if piece:
            step.calls.append(CallDelta(self._index, piece))
        return self._closed(step)

    def _closed(self, step: BodyStep) -> str | None:
        if self._args.rest is None:
            return None
        step.calls.append(CallDelta(self._index, done=True))
        self._state, self._buffer = "tail", ""
        return self._args.rest

    def _tail(self, text: str, step: BodyStep) -> str | None:
        """After the arguments (the closing fence), or a broken call: up to its end tag."""
        self._buffer += text
        at, tag = find_first(self._buffer, (CALL_END,))
        if tag is None:
            self._buffer = self._buffer[at:]  # only what may begin the tag
            return None
        rest, self._state, self._buffer = self._buffer[at + len(CALL_END):], "between", ""
        return rest


class DeepSeekV3ToolParser(TaggedToolParser):
    name = "deepseek_v3"
    special_tags = True
    OPEN = CALLS_BEGIN

    def _new_body(self) -> CallsBody:
        return _DeepSeekBody(self)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        picked = grammar_functions(tools, choice)
        if picked is None:
            return None
        functions, bind_all = picked
        more = ' ("\\n" call)*' if repeats(choice, parallel) else ""
        rules = [
            f"calls: call{more} {lit(CALLS_END)}",
            f"call: {lit(CALL_BEGIN + 'function' + SEP)} ({function_alternatives(functions)}) "
            f"{lit(chr(10) + '```' + CALL_END)}",
            *(f"fn_{i}: {lit(f.name + chr(10) + '```json' + chr(10))} {arguments_json(f, bind_all or bool(f.strict))}"
              for i, f in enumerate(functions)),
        ]
        return tagged_calls_grammar(CALLS_BEGIN, rules, bind_all)

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "## Tools\nYou have access to the following functions:\n"
            f"{tool_list(tools)}\n\n"
            "To call functions, reply with:\n"
            f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<function-name>\n```json\n<args-json-object>\n```{CALL_END}"
            f"{CALLS_END}"
        )
        # Earlier calls can only be written as JSON objects (ToolPrompt's one call shape).
        return ToolPrompt(section, "", "", "arguments", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
