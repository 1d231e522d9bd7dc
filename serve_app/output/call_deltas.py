"""A tool call as it streams: `CallDelta`s (its id and name, then pieces of its arguments),
and the calls they add up to."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class CallDelta:
    """A piece of one call of a choice. Its first piece carries `id` and `name` (and maybe
    the start of the arguments); later ones only text to append to `arguments`. `done`:
    the call is whole (its arguments closed). A call never done was cut off or broken:
    it is not part of the answer, though its first pieces may have been streamed."""

    index: int  # the call's position among the choice's calls
    arguments: str = ""
    id: str | None = None
    name: str | None = None
    done: bool = False


@dataclass
class _Call:
    id: str = ""
    name: str = ""
    parts: list[str] = field(default_factory=list)
    done: bool = False


class CallAssembly:
    """A choice's calls put together from their deltas: what the non-streamed message holds."""

    def __init__(self) -> None:
        self._calls: dict[int, _Call] = {}

    def add(self, deltas: Iterable[CallDelta]) -> list[ParsedCall]:
        """Take the deltas; returns the calls they complete (for readers of whole calls)."""
        completed = []
        for delta in deltas:
            call = self._calls.setdefault(delta.index, _Call())
            if delta.id is not None:
                call.id, call.name = delta.id, delta.name or ""
            call.parts.append(delta.arguments)
            if delta.done and not call.done:
                call.done = True
                completed.append(ParsedCall(call.id, call.name, "".join(call.parts)))
        return completed

    def complete(self) -> list[ParsedCall]:
        """The whole calls, in order; cut or broken ones are left out."""
        return [ParsedCall(c.id, c.name, "".join(c.parts)) for _, c in sorted(self._calls.items()) if c.done]

    def __bool__(self) -> bool:
        return any(c.done for c in self._calls.values())


def merged(deltas: Iterable[CallDelta]) -> list[CallDelta]:
    """The whole calls as one delta each (what a parser returns for a whole text)."""
    assembly = CallAssembly()
    assembly.add(deltas)
    return [CallDelta(i, c.arguments, c.id, c.name, True) for i, c in enumerate(assembly.complete())]
