"""Tool-call parsing of a whole text at once, for tests: what the streaming parsers of
serve_app/output/tool_parsers.py give for `text` pushed in one piece, then finished."""

from __future__ import annotations

from serve_app.output.call_deltas import merged
from serve_app.output.tool_parsers import ToolOutput, ToolParser
from serve_app.schema.tools import Tool


def parse_whole(parser_cls: type[ToolParser], text: str, tools: list[Tool], forced: bool = False) -> ToolOutput:
    """A whole text: its content and its whole calls, one delta each."""
    parser = parser_cls(tools, forced)
    first, last = parser.push(text), parser.finish()
    return ToolOutput(first.content + last.content, merged(first.calls + last.calls))


def streamed(parser_cls: type[ToolParser], pieces: list[str], tools: list[Tool], forced: bool = False) -> ToolOutput:
    """The content and the whole calls of a text pushed in `pieces`; checks on the way that
    each call's deltas have OpenAI's shape (id and name on the first only, calls numbered
    in order from 0) and add up to its arguments."""
    parser = parser_cls(tools, forced)
    content, deltas = "", []
    for piece in [*pieces, None]:
        out = parser.push(piece) if piece is not None else parser.finish()
        content += out.content
        deltas += out.calls
    seen: set[int] = set()
    for delta in deltas:
        first = delta.index not in seen
        assert (delta.id is not None) == first and (delta.name is not None) == first, deltas
        seen.add(delta.index)
    assert sorted(seen) == list(range(len(seen)))
    return ToolOutput(content, merged(deltas))


def splits(text: str):
    """The text in two pieces at every point, in three around each pair of points a few
    characters apart, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    for i in range(len(text)):
        yield [text[:i], text[i:i + 3], text[i + 3:]]
    yield list(text)
