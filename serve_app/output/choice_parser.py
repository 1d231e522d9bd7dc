"""What `/v1/chat/completions` reads out of a choice's text: reasoning, content, tool calls.

The model's text goes through the reasoning parser first (if the model has one), then
its content part through the tool-call parser (if the request has tools in play), so
a `<tool_call>` written while thinking is reasoning, never a call. The accumulator and
the streamer of serve_app/dialects/chat/output.py both use one `ChoiceParser` per choice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from serve_app.output.call_deltas import CallDelta
from serve_app.output.reasoning_parsers import REASONING_PARSERS, ReasoningParser
from serve_app.output.tool_parsers import PARSERS, ToolParser
from serve_app.schema.tools import Tool, ToolUse
from workers.contract.chunks import GenerationChunk
from workers.contract.model_config import ModelConfig


@dataclass
class ParsedDelta:
    reasoning: str = ""
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.calls)

    def extend(self, other: "ParsedDelta") -> "ParsedDelta":
        return ParsedDelta(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


@dataclass(frozen=True)
class OutputParsing:
    """The parsers that apply to one request's output."""

    tools: tuple[Tool, ...] = ()
    tool_parser: type[ToolParser] | None = None
    reasoning_parser: type[ReasoningParser] | None = None
    forced_calls: bool = False  # tool_choice required or named: the grammar makes the output calls

    @classmethod
    def of(cls, req: ToolUse, model: ModelConfig | None) -> "OutputParsing":
        if model is None:
            return cls()
        tools = tuple(req.tools_in_play)
        return cls(
            tools=tools,
            tool_parser=PARSERS[model.tool_call_parser] if tools else None,
            reasoning_parser=REASONING_PARSERS[model.reasoning_parser] if model.reasoning_parser else None,
            forced_calls=req.forced_tool_calls,
        )

    @property
    def active(self) -> bool:
        return self.tool_parser is not None or self.reasoning_parser is not None

    def new_choice(self, reasoning_open: bool) -> "ChoiceParser":
        reasoning = self.reasoning_parser(reasoning_open) if self.reasoning_parser else None
        tools = self.tool_parser(list(self.tools), self.forced_calls) if self.tool_parser else None
        return ChoiceParser(reasoning, tools)


class ChoiceParser:
    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self._reasoning = reasoning
        self._tools = tools

    @property
    def reasoning_tokens(self) -> int:
        return self._reasoning.reasoning_tokens if self._reasoning else 0

    def push(self, text: str, num_tokens: int) -> ParsedDelta:
        if self._reasoning is None:
            return self._content(text)
        part = self._reasoning.push(text, num_tokens)
        return ParsedDelta(reasoning=part.reasoning).extend(self._content(part.content))

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._reasoning is not None:
            part = self._reasoning.finish()
            out = ParsedDelta(reasoning=part.reasoning).extend(self._content(part.content))
        if self._tools is not None:
            last = self._tools.finish()
            out = out.extend(ParsedDelta(content=last.content, calls=last.calls))
        return out

    def _content(self, text: str) -> ParsedDelta:
        if self._tools is None or not text:
            return ParsedDelta(content=text)
        out = self._tools.push(text)
        return ParsedDelta(content=out.content, calls=out.calls)


class ChunkReader:
    """One choice's worker chunks read by the request's parsers: the parser is made on the
    first chunk (whose `reasoning_open` says whether the output starts inside reasoning),
    and the chunk that finishes the choice flushes it."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self.parser: ChoiceParser | None = None

    def read(self, chunk: GenerationChunk) -> ParsedDelta:
        if not self.parsing.active:
            return ParsedDelta(content=chunk.text)
        if self.parser is None:
            self.parser = self.parsing.new_choice(chunk.reasoning_open)
        parsed = self.parser.push(chunk.text, len(chunk.token_ids))
        if chunk.finish_reason is not None:
            parsed = parsed.extend(self.parser.finish())
        return parsed

    @property
    def reasoning_tokens(self) -> int:
        return self.parser.reasoning_tokens if self.parser else 0
