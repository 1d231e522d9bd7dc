"""Earlier answers as a source of proposals (speculative method `suffix`): the outputs of
the model's last finished requests, each after the tail of its prompt, with a table from
their n-grams to the position after their latest occurrence.

Why: an agent's tool loop, a retried request and a re-run edit make answers that repeat
earlier answers rather than their own prompt; prompt lookup cannot see those. One table
for all stored answers keeps a lookup a few dict probes; an answer leaving the history
(oldest first) takes out the entries that still point into it, so the table stays the
size of what is stored."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MATCH_CAP = 64  # how far back a match is measured when two sources compete


@dataclass(frozen=True)
class Match:
    """A proposal and how many tokens before it matched the sequence's end (at most MATCH_CAP)."""

    tokens: list[int]
    length: int


def matched_length(context: list[int], source: list[int], after: int) -> int:
    """How many tokens before `source[after]` equal the end of `context`, up to MATCH_CAP."""
    length, limit = 0, min(MATCH_CAP, after, len(context))
    while length < limit and source[after - 1 - length] == context[-1 - length]:
        length += 1
    return length


class ResponseHistory:
    """The last `max_requests` finished answers (per LoRA adapter: another adapter's answers
    are another model's), each stored with its prompt's last `longest` tokens before it."""

    def __init__(self, shortest: int, longest: int, max_requests: int) -> None:
        self.shortest, self.longest, self.max_requests = shortest, longest, max_requests
        self._answers: dict[int, tuple[str | None, list[int]]] = {}
        self._order: deque[int] = deque()
        self._next: dict[tuple, tuple[int, int]] = {}  # (adapter, n-gram) -> (answer, position after)
        self._serial = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def entries(self) -> int:
        return len(self._next)

    def add(self, prompt: list[int], output: list[int], adapter: str | None = None) -> None:
        """Store a finished request's `output` (after its `prompt`'s tail)."""
        if not output:
            return
        tokens = prompt[-self.longest:] + output
        serial, self._serial = self._serial, self._serial + 1
        self._answers[serial] = (adapter, tokens)
        self._order.append(serial)
        for key, end in self._keys(adapter, tokens):
            self._next[key] = (serial, end)
        while len(self._order) > self.max_requests:
            self._remove(self._order.popleft())

    def _keys(self, adapter: str | None, tokens: list[int]):
        """Each n-gram of `tokens` that has a token after it, with that token's position."""
        for end in range(self.shortest, len(tokens)):
            for n in range(self.shortest, min(self.longest, end) + 1):
                yield (adapter, *tokens[end - n : end]), end

    def _remove(self, serial: int) -> None:
        adapter, tokens = self._answers.pop(serial)
        for key, _ in self._keys(adapter, tokens):
            if self._next.get(key, (None,))[0] == serial:
                del self._next[key]

    def lookup(self, context: list[int], count: int, adapter: str | None = None) -> Match | None:
        """Up to `count` tokens that followed the longest suffix of `context` in a stored answer."""
        for n in range(min(self.longest, len(context)), self.shortest - 1, -1):
            key = (adapter, *context[len(context) - n :])
            found = self._next.get(key)
            if found is not None:
                answer, after = self._answers[found[0]][1], found[1]
                return Match(answer[after : after + count], matched_length(context, answer, after))
        return None
