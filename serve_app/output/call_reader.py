"""One tool call object, `{"name": ..., "arguments": {...}}`, read as it streams: the call
is announced once its function is known, then its arguments go out as they are written.

The markup around the object (tags, separators) is the format's business
(serve_app/output/tool_parsers.py). The arguments are passed on as the model wrote them,
so the pieces streamed add up exactly to the non-streamed `arguments`. Calls written
another way (arguments first, arguments as a JSON string, no arguments) are read whole
when they end, as one piece.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.json_object_end import ObjectEnd
from workers.contract.json_text import loads_json_text

# The usual start of a call, up to the brace that opens its arguments.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
# The head is at most whitespace, the keys and a function name (64 characters): a longer
# text without it is a call written another way, read whole (this also bounds the work of
# matching the head again as its pieces arrive).
_HEAD_LIMIT = 256


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_from(obj: Any, names: set[str], arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON text) of a call object with a known name and object arguments."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj.get(key, {}) if key is not None else {}
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = loads_json_text(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


class CallReader:
    """The text of one call object, pushed piece by piece.

    States: `head` (the name and the start of the arguments not yet seen), `arguments`
    (streamed), `tail` (after the arguments' closing brace), `whole` (an unusual shape,
    parsed at the end). `next_index` numbers the choice's calls; a call takes its number
    when it is announced."""

    def __init__(self, names: set[str], arguments_keys: tuple[str, ...], next_index: Callable[[], int]) -> None:
        self._names = names
        self._keys = arguments_keys
        self._next_index = next_index
        self.state = "head"
        self.index = -1
        self._text: list[str] = []  # everything pushed (read whole in state head / whole)
        self._head = ""
        self._arguments = ObjectEnd()
        self._tail = ""
        self.rest: str | None = None  # text after the call object's closing brace, once seen

    @property
    def announced(self) -> bool:
        """Whether the call's first delta went out (so its text is never content)."""
        return self.state in ("arguments", "tail")

    @property
    def body(self) -> str:
        return "".join(self._text)

    def push(self, text: str) -> CallDelta | None:
        if not text:
            return None
        self._text.append(text)
        if self.state == "head":
            return self._read_head(text)
        if self.state == "arguments":
            piece = self._read_arguments(text)
            return CallDelta(self.index, piece) if piece else None
        if self.state == "tail":
            self._read_tail(text)
        return None

    def end(self) -> CallDelta | None:
        """The call's last delta (`done`) when it is a whole call; None when it is not one:
        cut off or broken (if announced, it stays unfinished), or not a call at all."""
        if self.state == "tail":
            return CallDelta(self.index, done=True)
        if self.state == "arguments":
            return None
        try:
            call = call_from(loads_json_text(self.body), self._names, self._keys)
        except ValueError:
            call = None
        if call is None:
            return None
        self.index = self._next_index()
        return CallDelta(self.index, call[1], new_call_id(), call[0], done=True)

    def _read_head(self, text: str) -> CallDelta | None:
        self._head += text
        found = _HEAD.match(self._head)
        if found is None:
            if len(self._head) > _HEAD_LIMIT:
                self.state = "whole"
            return None
        name, rest = found.group(1), self._head[found.end():]
        if name not in self._names or not rest.startswith("{"):
            self.state = "whole"
            return None
        self.state, self.index = "arguments", self._next_index()
        return CallDelta(self.index, self._read_arguments(rest), new_call_id(), name)

    def _read_arguments(self, text: str) -> str:
        end = self._arguments.feed(text)
        if end is None:
            return text
        self.state = "tail"
        self._read_tail(text[end:])
        return text[:end]

    def _read_tail(self, text: str) -> None:
        """After the arguments: the call object's own closing brace (formats without a
        closing tag end the call there)."""
        if self.rest is not None:
            self.rest += text
            return
        self._tail += text
        close = self._tail.find("}")
        if close >= 0:
            self.rest = self._tail[close + 1:]
