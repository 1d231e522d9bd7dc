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
