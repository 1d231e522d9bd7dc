"""Mistral's tool calls (`tool_call_parser: mistral`): calls after the `[TOOL_CALLS]` tag.

Two spellings, both read:

- a JSON list (Mistral 7B v0.3, Mixtral, Nemo):
  `[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {...}]`;
- the name before its arguments (tokenizer v11 and later: Mistral Small 3.x, Devstral,
  Magistral): `[TOOL_CALLS]add[ARGS]{"a": 1}` (or `add{...}`, or with `[CALL_ID]id`
  before `[ARGS]`), one tag per call.

Text before the tag is content. A call is announced once its name is known and its
arguments stream as written (the list's objects through serve_app/output/call_reader.py);
a call whose arguments closed is whole, even if the output ends before the list does.
Markup that is not a call, found before anything was announced (an unknown function, a
list of something else), is content. The forced grammar lets the model pick either
spelling.

`[TOOL_CALLS]` is a special token of Mistral's tokenizers: the parser sees it only when
the output is decoded with `skip_special_tokens` false. The grammar spells the tags as
text, which a model may write with ordinary tokens.
"""

from __future__ import annotations

import re
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import CallReader, new_call_id
from serve_app.output.json_object_end import ObjectEnd
from serve_app.output.tool_parser_base import (
    ArgumentsText,
    BodyStep,
    CallsBody,
    Head,
    TaggedToolParser,
    arguments_json,
    calls_schema,
    function_alternatives,
    grammar_functions,
    lit,
    repeats,
    tagged_calls_grammar,
    tool_list,
)
from serve_app.schema.tools import Tool
from workers.contract.requests import ToolPrompt

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
# The name form's head, up to the brace that opens the arguments.
_NAMED_HEAD = re.compile(r"\s*([A-Za-z0-9_-]{1,64})(?:\[CALL_ID\][A-Za-z0-9_-]*)?(?:\[ARGS\])?\s*\{")
# What the head may be before its brace: a name and tags, whitespace only around them (so
# "[TOOL_CALLS] Sorry, no" is text at once).
_HEAD_SO_FAR = re.compile(r"\s*[A-Za-z0-9_\-\[\]]*\s*")


class _MistralBody(CallsBody):
    """What follows one `[TOOL_CALLS]`: a list of call objects, or one named call."""

    def __init__(self, parser: MistralToolParser) -> None:
        self._parser = parser
        self._state = "start"  # then head -> arguments, or the list: between <-> element
        self._buffer = ""  # undecided text between the list's elements
        self._raw = ""  # everything read, while nothing was announced (given back if not calls)
        self._announced = False
        self._index = -1  # the named call's
        self._head = Head(_NAMED_HEAD, "{", viable=_HEAD_SO_FAR)
        self._arguments: ArgumentsText | None = None  # the named call's arguments
        self._call: CallReader | None = None  # the list's current object ...
        self._end = ObjectEnd()  # ... and where it closes

    def push(self, text: str) -> BodyStep:
        if not self._announced:
            self._raw += text
        step = BodyStep()
        if self._state == "start":
            head = text.lstrip()
            if not head:
                return step
            if head[0] == "[":  # the list opens: read on as if after a comma
                self._state, self._buffer, text = "between", ",", head[1:]
            else:
                self._state = "head"
        if self._state == "head":
            return self._read_head(text, step)
        if self._state == "arguments":
            return self._read_arguments(text, step)
        return self._read_list(text, step)

    def finish(self) -> list[CallDelta]:
        if self._state == "element" and self._call is not None and self._call.state == "tail":
            last = self._call.end()  # its arguments closed, only the object's brace is missing
            return [last] if last is not None else []
        return []

    # The name form.

    def _read_head(self, text: str, step: BodyStep) -> BodyStep:
        if not self._head.push(text):
            return step
        name = self._head.match.group(1) if self._head.match else None
        if name not in self._parser.names:
            step.rejected = self._raw
            return step
        self._state, self._announced = "arguments", True
        self._index = self._parser._next_index()
        self._arguments = ArgumentsText()
        piece = self._arguments.push("{" + self._head.rest)
        step.calls.append(CallDelta(self._index, piece, new_call_id(), name))
        return self._arguments_closed(step)

    def _read_arguments(self, text: str, step: BodyStep) -> BodyStep:
        piece = self._arguments.push(text)
        if piece:
            step.calls.append(CallDelta(self._index, piece))
        return self._arguments_closed(step)

    def _arguments_closed(self, step: BodyStep) -> BodyStep:
        if self._arguments.rest is not None:
            step.calls.append(CallDelta(self._index, done=True))
            step.rest = self._arguments.rest
        return step

    # The list form.

    def _read_list(self, text: str, step: BodyStep) -> BodyStep:
        while True:
            if self._state == "element":
                text = self._read_element(text, step)
                if text is None or step.rejected is not None:
                    return step
                self._state = "between"
            self._buffer += text
            head = self._buffer.lstrip()
            if not head:
                return step
            if head[0] == "]":  # the list is over
                step.rest = head[1:]
                return step
            if head[0] == "," and head[1:].lstrip()[:1] == "{":
                self._state, text, self._buffer = "element", head[1:].lstrip(), ""
                self._call, self._end = self._parser._reader(), ObjectEnd()
                continue
            if head[0] == "," and not head[1:].strip():
                return step  # the next element is still to come
            if not self._announced:  # a list of something else: not calls
                step.rejected = self._raw
            else:  # the list breaks off: what follows is text
                step.rest = head
            return step

    def _read_element(self, text: str, step: BodyStep) -> str | None:
        """Feed the current object; the text after it once it closed, else None."""
        end = self._end.feed(text)
        delta = self._call.push(text if end is None else text[:end])
        if delta is not None:
            step.calls.append(delta)
            self._announced = True
        if end is None:
            return None
        last = self._call.end()
        if last is not None:
            step.calls.append(last)
            self._announced = True
        elif not self._announced and not self._parser.forced:
            step.rejected = self._raw
        return text[end:]


class MistralToolParser(TaggedToolParser):
    name = "mistral"
    special_tags = True
    OPEN = TOOL_CALLS

    def _new_body(self) -> CallsBody:
        return _MistralBody(self)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        picked = grammar_functions(tools, choice)
        if picked is None:
            return None
        functions, bind_all = picked
        many = repeats(choice, parallel)
        # The list spelling (one schema for a call to any function) or the named one (a
        # rule per function, its arguments bound when forced or strict).
        listed = '"[" call' + (' (", " call)*' if many else "") + ' "]"'
        named = "named" + (f" ({lit(TOOL_CALLS)} named)*" if many else "")
        rules = [
            f"calls: {listed} | {named}",
            f"call: %json {calls_schema(functions, 'arguments', bind_all)}",
            "named: " + function_alternatives(functions),
            *(f"fn_{i}: {lit(f.name)} {lit(ARGS)}? {arguments_json(f, bind_all or bool(f.strict))}"
              for i, f in enumerate(functions)),
        ]
        return tagged_calls_grammar(TOOL_CALLS, rules, bind_all)

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            f"[AVAILABLE_TOOLS]\n{tool_list(tools)}\n[/AVAILABLE_TOOLS]\n\n"
            f"To call functions, answer with {TOOL_CALLS} and a JSON list of calls: "
            f'{TOOL_CALLS}[{{"name": <function-name>, "arguments": <args-json-object>}}]'
        )
        return ToolPrompt(section, TOOL_CALLS + "[", "]", "arguments", "[TOOL_RESULTS]", "[/TOOL_RESULTS]")
