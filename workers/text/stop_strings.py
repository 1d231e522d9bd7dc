"""Stop strings over streamed text, with hold-back so no text past a stop is ever sent.

While a request runs, the last `longest_stop - 1` characters are held back: they could
be the start of a stop string that the next tokens complete.
"""

from __future__ import annotations


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self.text = ""  # all text accepted so far (truncated at a stop once matched)
        self._sent = 0
        self.matched: str | None = None
        self._armed = True

    def push(self, delta: str, armed: bool = True) -> str:
        """Add new text; return the text now safe to send. After a match, returns the rest up to the stop.

        While not `armed` (min_tokens not reached), text passes through unmatched."""
        if self.matched is not None or not delta:
            return ""
        search_from = max(0, len(self.text) - self._hold) if self._armed else len(self.text)
        self._armed = armed
        self.text += delta
        if not armed:
            return self._take(len(self.text) - self._hold)
        hit = self._find(search_from)
        if hit is not None:
            index, stop = hit
            self.matched = stop
            self.text = self.text[: index + len(stop)] if self._include else self.text[:index]
            return self._take(len(self.text))
        return self._take(len(self.text) - self._hold)

    @property
    def released(self) -> int:
        """How many characters of `text` have been returned so far."""
        return self._sent

    def flush(self) -> str:
        """The request ended without a match: release the held-back text."""
        return self._take(len(self.text))

    def _find(self, start: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            index = self.text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        return best

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        out = self.text[self._sent : end]
        self._sent = end
        return out
