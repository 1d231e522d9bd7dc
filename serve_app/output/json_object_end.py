"""Where a bracketed value ends, in text that arrives piece by piece: brackets balanced
outside string literals (quotes and escapes honoured). `ObjectEnd` reads a JSON object;
pythonic calls (serve_app/output/pythonic_calls.py) read a list element with their own
brackets and quotes."""

from __future__ import annotations

import re


class BalancedEnd:
    """Fed text piece by piece, finds the closing bracket that balances the first opener.

    Linear in the text: a regex jumps from one bracket or quote to the next, and each piece
    is scanned once. It only balances brackets outside strings; whether the text is
    otherwise valid is not its business (the caller decides what to do with it).
    `stray_ends`: a closer with nothing open ends the value just before it."""

    def __init__(self, openers: str = "{", closers: str = "}", quotes: str = '"', stray_ends: bool = False) -> None:
        self.depth = 0
        self._openers, self._quotes, self._stray_ends = openers, quotes, stray_ends
        self._outside = re.compile("[" + re.escape(openers + closers + quotes) + "]")  # what changes the state
        self._inside = {q: re.compile("[" + re.escape(q) + r"\\]") for q in quotes}  # ... inside a string
        self._quote: str | None = None
        self._escaped = False  # the last piece ended on a backslash inside a string

    def feed(self, text: str) -> int | None:
        """The index in `text` just past the balancing closer (with `stray_ends`, that of a
        stray closer itself), or None (not yet)."""
        i = 0
        if self._escaped and text:
            self._escaped, i = False, 1
        while i < len(text):
            if self._quote is not None:
                found = self._inside[self._quote].search(text, i)
                if found is None:
                    return None
                if found.group() == "\\":
                    if found.end() == len(text):
                        self._escaped = True
                        return None
                    i = found.end() + 1
                    continue
                self._quote, i = None, found.end()
                continue
            found = self._outside.search(text, i)
            if found is None:
                return None
            char, i = found.group(), found.end()
            if char in self._quotes:
                self._quote = char
            elif char in self._openers:
                self.depth += 1
            elif self.depth == 0 and self._stray_ends:
                return i - 1
            else:
                self.depth -= 1
                if self.depth == 0:
                    return i
        return None


class ObjectEnd(BalancedEnd):
    """Fed the text of a JSON value that starts with `{`, finds the brace that closes it."""
