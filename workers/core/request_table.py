"""The engine's live requests: each request id's live choices (its sequences). One object
owns the table; the engine's helpers (beam search, forks, step recovery, async
scheduling, a step's events) change it only through these methods."""

from __future__ import annotations

from workers.core.sequence import Sequence


class RequestTable:
    def __init__(self) -> None:
        self._live: dict[int, list[Sequence]] = {}

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._live

    def __len__(self) -> int:
        return len(self._live)

    def add(self, request_id: int, choices: list[Sequence]) -> None:
        self._live[request_id] = choices

    def choices(self, request_id: int) -> list[Sequence]:
        """The request's live choices (none once it ended)."""
        return self._live.get(request_id, [])

    def replace(self, request_id: int, choices: list[Sequence]) -> None:
        """A new set of live choices: beams after a beam step, or the set before a failed step."""
        self._live[request_id] = choices

    def add_forks(self, request_id: int, children: list[Sequence]) -> None:
        self._live[request_id].extend(children)

    def pop(self, request_id: int) -> list[Sequence]:
        """Forget the request; its choices that were live."""
        return self._live.pop(request_id, [])

    def retire(self, seq: Sequence) -> None:
        """A choice ended; its request leaves the table with its last live choice."""
        group = self._live.get(seq.request_id)
        if group is None:
            return
        group.remove(seq)
        if not group:
            del self._live[seq.request_id]
