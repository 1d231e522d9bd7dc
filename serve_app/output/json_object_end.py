"""Where a JSON object ends, in text that arrives piece by piece (strings and escapes honoured)."""

from __future__ import annotations

import re

_OUTSIDE = re.compile(r'[{}"]')  # what changes the state outside a string
_INSIDE = re.compile(r'["\\]')  # ... and inside one


class ObjectEnd:
    """Fed the text of a JSON value that starts with `{`, finds the brace that closes it.

    Linear in the text: a regex jumps from one brace or quote to the next, and each piece is
    scanned once. It only balances braces outside strings; whether the JSON is otherwise
    valid is not its business (the caller decides what to do with the text)."""

    def __init__(self) -> None:
        self.depth = 0
        self._in_string = False
        self._escaped = False  # the last piece ended on a backslash inside a string

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the brace that closes the object, or None (not yet)."""
        i = 0
        if self._escaped and text:
            self._escaped, i = False, 1
        while i < len(text):
            if self._in_string:
                found = _INSIDE.search(text, i)
                if found is None:
                    return None
                if found.group() == "\\":
                    if found.end() == len(text):
                        self._escaped = True
                        return None
                    i = found.end() + 1
                    continue
                self._in_string, i = False, found.end()
                continue
            found = _OUTSIDE.search(text, i)
            if found is None:
                return None
            i = found.end()
            if found.group() == '"':
                self._in_string = True
            elif found.group() == "{":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None
