"""Log-probabilities that travel with their token's text: a token's entry goes out when the
stop matcher releases its text, in streams too; the entries of tokens without text of their
own (a hidden EOS, text a stop string cut off) go out when the output ends."""

from __future__ import annotations

from dataclasses import dataclass

from workers.contract.chunks import TokenLogprob


@dataclass
class _Held:
    start: int  # the token's text in the matcher's text: [start, end)
    end: int
    logprob: TokenLogprob


class HeldLogprobs:
    def __init__(self) -> None:
        self._items: list[_Held] = []

    def add(self, start: int, end: int, logprob: TokenLogprob) -> None:
        """A token whose text is [start, end) of the output text. Tokens before it without
        text of their own (the first bytes of a character) go out with it."""
        if end > start:
            for item in reversed(self._items):
                if item.end != start or item.start != start:
                    break
                item.end = end
        self._items.append(_Held(start, end, logprob))

    def release(self, released: int) -> list[TokenLogprob]:
        """The entries whose text is all out (the first `released` characters)."""
        count = 0
        while count < len(self._items) and self._items[count].end <= released and \
                self._items[count].end > self._items[count].start:
            count += 1
        out = [item.logprob for item in self._items[:count]]
        del self._items[:count]
        return out

    def flush(self) -> list[TokenLogprob]:
        """The output ended: every entry left, also of tokens without text (the first bytes of
        a character the output never finished, whose bytes the entry's `bytes` carry though
        the text cannot show them; a hidden EOS or stop token; text a stop string cut off)."""
        out, self._items = [item.logprob for item in self._items], []
        return out
