"""Earlier answers as a source of proposals (speculative method `suffix`): the outputs of
the model's last finished requests, each after the tail of its prompt, with a table from
their n-grams to the position after their latest occurrence.

Why: an agent's tool loop, a retried request and a re-run edit make answers that repeat
earlier answers rather than their own prompt; prompt lookup cannot see those. One table
(per adapter) for all stored answers keeps a lookup one dict probe; an answer leaving the
history (oldest first) takes out the entries that still point into it, so the table stays
the size of what is stored (~0.25 KB a token)."""

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
    are another model's), each stored with its prompt's last `n` tokens before it, and
    matched on a context's last `n` tokens (one n-gram length: a finished request's answer
    is indexed on the engine thread, a few us a token)."""

    def __init__(self, n: int, max_requests: int) -> None:
        self.n, self.max_requests = n, max_requests
        self._answers: dict[int, tuple[str | None, list[int]]] = {}
        self._order: deque[int] = deque()
        self._tables: dict[str | None, dict[tuple[int, ...], tuple[int, int]]] = {}  # n-gram -> (answer, after)
        self._serial = 0

    def __len__(self) -> int:
        return len(self._order)

    @property
    def entries(self) -> int:
        return sum(len(table) for table in self._tables.values())

    def add(self, prompt: list[int], output: list[int], adapter: str | None = None) -> None:
        """Store a finished request's `output` (after its `prompt`'s tail)."""
        if not output:
            return
        tokens = prompt[-self.n:] + output
        serial, self._serial = self._serial, self._serial + 1
        self._answers[serial] = (adapter, tokens)
        self._order.append(serial)
        table = self._tables.setdefault(adapter, {})
        for key, end in self._ngrams(tokens):
            table[key] = (serial, end)
        while len(self._order) > self.max_requests:
            self._remove(self._order.popleft())

    def _ngrams(self, tokens: list[int]):
        """Each n-gram of `tokens` that has a token after it, with that token's position."""
        n = self.n
        return ((tuple(tokens[end - n : end]), end) for end in range(n, len(tokens)))

    def _remove(self, serial: int) -> None:
        adapter, tokens = self._answers.pop(serial)
        table = self._tables[adapter]
        for key, _ in self._ngrams(tokens):
            if table.get(key, (None,))[0] == serial:
                del table[key]
        if not table:
            del self._tables[adapter]

    def lookup(self, context: list[int], count: int, adapter: str | None = None) -> Match | None:
        """Up to `count` tokens that followed `context`'s last `n` tokens in the latest stored
        answer holding them."""
        table = self._tables.get(adapter)
        if table is None or len(context) < self.n:
            return None
        found = table.get(tuple(context[len(context) - self.n :]))
        if found is None:
            return None
        answer, after = self._answers[found[0]][1], found[1]
        return Match(answer[after : after + count], matched_length(context, answer, after))
