"""Tool-call formats: reading calls out of model text, and the grammar that forces them.

One class per format knows everything about it: how to find calls in the output
(streaming and not), the llguidance Lark grammar that constrains sampling to valid
calls (`tool_choice` required or named, `strict` functions), and how chatserve teaches
the format to a model whose chat template ignores tools (`ToolPrompt`).

- `hermes` (Qwen 2.5/3, Hermes, and chatserve's own rendering):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable, text around it.
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls are separated by `;`.

Streaming: text that may still become a call (a prefix of the opening tag, or an open
call) is held back; a call is emitted once it is complete and valid, so malformed
output (bad JSON, unknown function) is returned as content instead, and the streamed
and non-streamed answers are the same. Parsing never raises.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from serve_app.dialects.chat.request import FunctionDefinition, NamedToolChoice, Tool
from serve_app.output.tags import held_prefix
from workers.contract.json_text import loads_json_text
from workers.contract.requests import ToolPrompt

_WS = r"/[ \t\n]*/"


@dataclass(frozen=True)
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text


@dataclass
class ToolOutput:
    """What one piece of model text turned into."""

    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call_from(obj: Any, names: set[str], arguments_keys: tuple[str, ...]) -> ParsedCall | None:
    """A call object with a known name and object arguments, else None."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    arguments = obj.get(key, {}) if key is not None else {}
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = loads_json_text(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(new_call_id(), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _call_schema(function: FunctionDefinition, arguments_key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(functions: list[FunctionDefinition], arguments_key: str, bind_all: bool) -> str:
    """One JSON schema for a call to any of `functions` (llguidance wants anyOf, not rule
    alternatives); arguments are bound to the function's schema when forced or strict."""
    options, defs = [], {}
    for i, function in enumerate(functions):
        arguments: dict[str, Any] = {"type": "object"}
        if bind_all or function.strict:
            location = f"#/properties/{arguments_key}" if len(functions) == 1 else f"#/anyOf/{i}/properties/{arguments_key}"
            arguments, own_defs = _relocated(function.arguments_schema, location, f"f{i}_")
            defs.update(own_defs)
        options.append(_call_schema(function, arguments_key, arguments))
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    if defs:
        schema["$defs"] = defs
    # Compact JSON as models write it; flexible whitespace would let a model pad forever.
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return json.dumps(schema, ensure_ascii=False)


def _relocated(schema: dict[str, Any], location: str, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A function's parameters schema moved from a document root to `location` inside the
    call schema: its definitions (`$defs`, `definitions`, as pydantic writes them) go to
    the root's `$defs` under `prefix`, and its local `$ref`s are rewritten to follow."""

    def moved(ref: str) -> str:
        for key in ("#/$defs/", "#/definitions/"):
            if ref.startswith(key):
                return "#/$defs/" + prefix + ref[len(key):]
        return location + ref[1:]

    def fix(node: Any) -> Any:
        if isinstance(node, list):
            return [fix(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: fix(v) for k, v in node.items()}
        if isinstance(node.get("$ref"), str) and node["$ref"].startswith("#"):
            out["$ref"] = moved(node["$ref"])
        return out

    defs = {prefix + name: fix(sub) for key in ("$defs", "definitions") for name, sub in (schema.get(key) or {}).items()}
    body = fix({k: v for k, v in schema.items() if k not in ("$defs", "definitions")})
    return body, defs


def _tool_list(tools: list[Tool]) -> str:
    return "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)


class ToolParser(ABC):
    """One format. An instance parses one choice's output as it streams; `parse` reads a
    whole text; the class methods build the format's grammar and prompt section."""

    name: str = ""
    arguments_key: str = "arguments"

    def __init__(self, tools: list[Tool]) -> None:
        self.names = {t.function.name for t in tools}
        self.made_calls = False

    @abstractmethod
    def push(self, text: str) -> ToolOutput:
        """The content and calls this piece of text completes; the rest is held back."""

    @abstractmethod
    def finish(self) -> ToolOutput:
        """Everything still held back, at the end of the output."""

    @classmethod
    def parse(cls, text: str, tools: list[Tool]) -> ToolOutput:
        parser = cls(tools)
        first, last = parser.push(text), parser.finish()
        return ToolOutput(first.content + last.content, first.calls + last.calls)

    @classmethod
    @abstractmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        """The Lark grammar for `tool_choice` (required, named, or auto with strict
        functions); None when the output stays free."""

    @classmethod
    @abstractmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        """How to write tools and calls for a model whose template ignores tools."""


def forced_functions(tools: list[Tool], choice: Any) -> list[FunctionDefinition]:
    """The functions a forced choice allows: the named one, or all for "required"."""
    if isinstance(choice, NamedToolChoice):
        return [t.function for t in tools if t.function.name == choice.function.name]
    return [t.function for t in tools]


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[Tool]) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._in_call = False

    def push(self, text: str) -> ToolOutput:
        self._buffer += text
        out = ToolOutput()
        while True:
            if self._in_call:
                end = self._buffer.find(self.CLOSE)
                if end < 0:
                    return out
                self._close_call(self._buffer[:end], out)
                self._buffer = self._buffer[end + len(self.CLOSE):]
            else:
                start = self._buffer.find(self.OPEN)
                if start < 0:
                    self._emit_text(out)
                    return out
                out.content += self._buffer[:start].rstrip()  # whitespace before a call is not content
                self._buffer, self._in_call = self._buffer[start + len(self.OPEN):], True

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._in_call:  # cut off before the closing tag: a complete call still counts
            self._close_call(self._buffer, out, closed=False)
        elif self._buffer.strip() or not self.made_calls:
            out.content += self._buffer
        self._buffer = ""
        return out

    def _emit_text(self, out: ToolOutput) -> None:
        """Emit what cannot be the start of a call. Trailing whitespace waits: if a call
        follows (or the output ends after calls) it is dropped, else it is content."""
        held = held_prefix(self._buffer, self.OPEN)
        text = self._buffer[: len(self._buffer) - held].rstrip()
        out.content += text
        self._buffer = self._buffer[len(text):]

    def _close_call(self, body: str, out: ToolOutput, closed: bool = True) -> None:
        self._in_call = False
        try:
            call = _call_from(loads_json_text(body), self.names, ("arguments", "parameters"))
        except ValueError:
            call = None
        if call is None:
            out.content += self.OPEN + body + (self.CLOSE if closed else "")
            return
        self.made_calls = True
        out.calls.append(call)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        if choice == "auto":
            strict = [t.function for t in tools if t.function.strict]
            if not strict:
                return None
            # Free text; once the model writes the opening tag (a lazy trigger), the call
            # must be valid, with strict functions' arguments bound to their schemas.
            schema = _calls_schema([t.function for t in tools], "arguments", bind_all=False)
            # Parallel: calls and text in any order; else text, or text and one last call.
            start = "call* TEXT" if parallel else "TEXT | call"
            return (
                "%llguidance {}\n"
                f"start: {start}\n"
                "TEXT: /(.|\\n)*/\n"
                f'trigger[lazy]: TEXT "{cls.OPEN}"\n'
                f'call: trigger {_WS} %json {schema} {_WS} "{cls.CLOSE}"\n'
            )
        schema = _calls_schema(forced_functions(tools, choice), "arguments", bind_all=True)
        repeat = ' ("\\n" call)*' if parallel and not isinstance(choice, NamedToolChoice) else ""
        return (
            "%llguidance {}\n"
            f"start: call{repeat}\n"
            f'call: "{cls.OPEN}\\n" %json {schema} "\\n{cls.CLOSE}"\n'
        )

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{_tool_list(tools)}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            f'{cls.OPEN}{cls.CLOSE} XML tags:\n{cls.OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}'
            f"\n{cls.CLOSE}"
        )
        return ToolPrompt(section, cls.OPEN + "\n", "\n" + cls.CLOSE, "arguments",
                          "<tool_response>\n", "\n</tool_response>")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    arguments_key = "parameters"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tools: list[Tool]) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "text" or "call"

    def push(self, text: str) -> ToolOutput:
        self._buffer += text
        if self._mode is None:
            self._decide()
        if self._mode == "text":
            out, self._buffer = ToolOutput(self._buffer), ""
            return out
        return ToolOutput()  # undecided, or a call: wait for the end

    def finish(self) -> ToolOutput:
        text, self._buffer = self._buffer, ""
        if self._mode == "text" or not text:
            return ToolOutput(text)
        calls = self._calls(text)
        if calls is None:
            return ToolOutput(text)
        self.made_calls = bool(calls)
        return ToolOutput("", calls)

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        if not head or self.PYTHON_TAG.startswith(head):
            return  # still undecided
        self._mode = "call" if head.startswith(("{", self.PYTHON_TAG)) else "text"

    def _calls(self, text: str) -> list[ParsedCall] | None:
        """Every call of a `;`-separated list of JSON objects, or None if any is not one."""
        rest = text.strip().removeprefix(self.PYTHON_TAG)
        decoder, calls = json.JSONDecoder(), []
        while rest.strip(" \n\t;"):
            rest = rest.lstrip(" \n\t;")
            try:
                obj, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):  # malformed, or nested past Python's limit
                return None
            call = _call_from(obj, self.names, ("parameters", "arguments"))
            if call is None:
                return None
            calls.append(call)
            rest = rest[end:]
        return calls

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        if choice == "auto":
            if not any(t.function.strict for t in tools):
                return None
            # Plain text that cannot be taken for a call, or calls whose arguments are bound.
            schema = _calls_schema([t.function for t in tools], "parameters", bind_all=False)
            repeat = ' ("; " call)*' if parallel else ""
            return (
                "%llguidance {}\n"
                "start: TEXT | calls\n"
                "TEXT: /[ \\t\\n]*([^{ \\t\\n<](.|\\n)*)?/\n"
                f"calls: call{repeat}\n"
                f"call: %json {schema}\n"
            )
        schema = _calls_schema(forced_functions(tools, choice), "parameters", bind_all=True)
        repeat = ' ("; " call)*' if parallel and not isinstance(choice, NamedToolChoice) else ""
        return f"%llguidance {{}}\nstart: call{repeat}\ncall: %json {schema}\n"

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "You have access to the following functions:\n"
            f"{_tool_list(tools)}\n\n"
            "To call a function, respond only with a JSON object of the form "
            '{"name": <function-name>, "parameters": <args-json-object>} and nothing else. '
            "Otherwise answer in plain text."
        )
        return ToolPrompt(section, "", "", "parameters", "Function result:\n", "")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
