"""Tool-call formats: reading calls out of model text, and the grammar that forces them.

One class per format knows everything about it: how to find calls in the output
(streaming and not), the llguidance Lark grammar that constrains sampling to valid
calls (`tool_choice` required or named, `strict` functions), and how chatserve teaches
the format to a model whose chat template ignores tools (`ToolPrompt`). `PARSERS` maps
the model config's `tool_call_parser` to its class.

- `hermes` (Qwen 2.5/3, Hermes, and chatserve's own rendering):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeatable, text around it.
- `llama3_json` (Llama 3.1+): the whole answer is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls are separated by `;`.
- `mistral`, `pythonic` (Llama 3.2/4), `qwen3_coder`, `deepseek_v3`, `openai` (gpt-oss's
  harmony): their own modules (serve_app/output/mistral_calls.py, pythonic_calls.py,
  xml_calls.py, deepseek_calls.py, harmony.py);
  what formats share is in serve_app/output/tool_parser_base.py.

Streaming: text that may still become a call (a prefix of the opening tag) is held back; a
call is announced once its function is known and its arguments stream as they are written
(serve_app/output/call_reader.py), so the streamed and non-streamed calls are the same.
Markup of a call the output cut off is never content: the call is left out of the answer
(its first pieces may have streamed; `finish_reason` says "length"). A closed call that is
not one (bad JSON before the arguments, an unknown function) is content, unless the
grammar forced calls. Parsing never raises.
"""

from __future__ import annotations

import json
from typing import Any

from serve_app.output.call_deltas import CallDelta, ParsedCall
from serve_app.output.call_reader import CallReader, call_from, new_call_id
from serve_app.output.deepseek_calls import DeepSeekV3ToolParser
from serve_app.output.harmony import HarmonyToolParser
from serve_app.output.mistral_calls import MistralToolParser
from serve_app.output.pythonic_calls import PythonicToolParser
from serve_app.output.tags import held_prefix
from serve_app.output.tool_parser_base import (
    WS,
    ToolOutput,
    ToolParser,
    calls_schema,
    forced_functions,
    tool_list,
)
from serve_app.output.xml_calls import Qwen3CoderToolParser
from serve_app.schema.tools import NamedToolChoice, Tool
from workers.contract.requests import ToolPrompt

__all__ = ["PARSERS", "CallDelta", "DeepSeekV3ToolParser", "HarmonyToolParser", "HermesToolParser", "Llama3JsonToolParser",
           "MistralToolParser", "ParsedCall", "PythonicToolParser", "Qwen3CoderToolParser", "ToolOutput", "ToolParser",
           "forced_functions"]


class HermesToolParser(ToolParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self._buffer = ""
        self._call: CallReader | None = None  # the call being read, between the tags

    def push(self, text: str) -> ToolOutput:
        self._buffer += text
        out = ToolOutput()
        while True:
            if self._call is not None:
                if not self._feed_call(out):
                    return out
                continue
            start = self._buffer.find(self.OPEN)
            if start < 0:
                self._emit_text(out)
                return out
            out.content += self._buffer[:start].rstrip()  # whitespace before a call is not content
            self._buffer, self._call = self._buffer[start + len(self.OPEN):], self._reader()

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._call is not None:  # no closing tag: a complete call still counts, a cut one never
            if self._call.state != "arguments":  # a held tag prefix cannot complete the arguments
                self._add(out, self._call.push(self._buffer))
            self._close_call(out, closed=False)
        elif self._buffer.strip() or not self.made_calls:
            out.content += self._buffer
        self._buffer = ""
        return out

    def _feed_call(self, out: ToolOutput) -> bool:
        """Give the open call its text up to the closing tag (holding back what may start
        the tag); True when the tag closed it."""
        end = self._buffer.find(self.CLOSE)
        if end < 0:
            cut = len(self._buffer) - held_prefix(self._buffer, self.CLOSE)
            self._add(out, self._call.push(self._buffer[:cut]))
            self._buffer = self._buffer[cut:]
            return False
        self._add(out, self._call.push(self._buffer[:end]))
        self._buffer = self._buffer[end + len(self.CLOSE):]
        self._close_call(out, closed=True)
        return True

    def _emit_text(self, out: ToolOutput) -> None:
        """Emit what cannot be the start of a call. Trailing whitespace waits: if a call
        follows (or the output ends after calls) it is dropped, else it is content."""
        held = held_prefix(self._buffer, self.OPEN)
        text = self._buffer[: len(self._buffer) - held].rstrip()
        out.content += text
        self._buffer = self._buffer[len(text):]

    def _close_call(self, out: ToolOutput, closed: bool) -> None:
        call, self._call = self._call, None
        last = call.end()
        if last is not None:
            out.calls.append(last)
        elif closed and not call.announced and not self.forced:
            out.content += self.OPEN + call.body + self.CLOSE  # closed, but not a call: the model's text
        # else: cut off, or broken after it was announced: neither content nor a call

    @staticmethod
    def _add(out: ToolOutput, delta: CallDelta | None) -> None:
        if delta is not None:
            out.calls.append(delta)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        if choice == "auto":
            strict = [t.function for t in tools if t.function.strict]
            if not strict:
                return None
            # Free text; once the model writes the opening tag (a lazy trigger), the call
            # must be valid, with strict functions' arguments bound to their schemas.
            schema = calls_schema([t.function for t in tools], "arguments", bind_all=False)
            # Parallel: calls and text in any order; else text, or text and one last call.
            start = "call* TEXT" if parallel else "TEXT | call"
            return (
                "%llguidance {}\n"
                f"start: {start}\n"
                "TEXT: /(.|\\n)*/\n"
                f'trigger[lazy]: TEXT "{cls.OPEN}"\n'
                f'call: trigger {WS} %json {schema} {WS} "{cls.CLOSE}"\n'
            )
        schema = calls_schema(forced_functions(tools, choice), "arguments", bind_all=True)
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
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tool_list(tools)}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            f'{cls.OPEN}{cls.CLOSE} XML tags:\n{cls.OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}'
            f"\n{cls.CLOSE}"
        )
        return ToolPrompt(section, cls.OPEN + "\n", "\n" + cls.CLOSE, "arguments",
                          "<tool_response>\n", "\n</tool_response>")


class Llama3JsonToolParser(ToolParser):
    """Under `auto` the whole answer is either text or calls, so calls are read when the
    output ends (an answer that is not all valid calls is content). Forced, the grammar
    makes it calls: each streams like a hermes call and ends at its closing brace."""

    name = "llama3_json"
    arguments_key = "parameters"
    arguments_keys = ("parameters", "arguments")
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self._buffer = ""
        self._mode: str | None = None  # None: undecided; "text" or "call"
        self._call: CallReader | None = None  # forced: the call being read

    def push(self, text: str) -> ToolOutput:
        if self.forced:
            return self._push_forced(text)
        self._buffer += text
        if self._mode is None:
            self._decide()
        if self._mode == "text":
            out, self._buffer = ToolOutput(self._buffer), ""
            return out
        return ToolOutput()  # undecided, or a call: wait for the end

    def finish(self) -> ToolOutput:
        if self.forced:
            return self._finish_forced()
        text, self._buffer = self._buffer, ""
        if self._mode == "text" or not text:
            return ToolOutput(text)
        calls = self._calls(text)
        if calls is None:
            return ToolOutput(text)
        return ToolOutput("", calls)

    def _push_forced(self, text: str) -> ToolOutput:
        """Calls one after the other; what lies between them (`; `, the python tag) is markup."""
        out = ToolOutput()
        while text:
            if self._call is None:
                start = text.find("{")
                if start < 0:
                    return out
                text, self._call = text[start:], self._reader()
            if (delta := self._call.push(text)) is not None:
                out.calls.append(delta)
            if self._call.rest is None:
                return out
            text = self._call.rest
            if (last := self._call.end()) is not None:
                out.calls.append(last)
            self._call = None
        return out

    def _finish_forced(self) -> ToolOutput:
        call, self._call = self._call, None
        last = call.end() if call is not None else None  # whole, or cut off: left out
        return ToolOutput("", [last] if last is not None else [])

    def _decide(self) -> None:
        head = self._buffer.lstrip()
        if not head or self.PYTHON_TAG.startswith(head):
            return  # still undecided
        self._mode = "call" if head.startswith(("{", self.PYTHON_TAG)) else "text"

    def _calls(self, text: str) -> list[CallDelta] | None:
        """Every call of a `;`-separated list of JSON objects, or None if any is not one."""
        rest = text.strip().removeprefix(self.PYTHON_TAG)
        decoder, found = json.JSONDecoder(), []
        while rest.strip(" \n\t;"):
            rest = rest.lstrip(" \n\t;")
            try:
                obj, end = decoder.raw_decode(rest)
            except (ValueError, RecursionError):  # malformed, or nested past Python's limit
                return None
            call = call_from(obj, self.names, self.arguments_keys)
            if call is None:
                return None
            found.append(call)
            rest = rest[end:]
        return [CallDelta(self._next_index(), arguments, new_call_id(), name, done=True) for name, arguments in found]

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        if choice == "auto":
            if not any(t.function.strict for t in tools):
                return None
            # Plain text that cannot be taken for a call, or calls whose arguments are bound.
            schema = calls_schema([t.function for t in tools], "parameters", bind_all=False)
            repeat = ' ("; " call)*' if parallel else ""
            return (
                "%llguidance {}\n"
                "start: TEXT | calls\n"
                "TEXT: /[ \\t\\n]*([^{ \\t\\n<](.|\\n)*)?/\n"
                f"calls: call{repeat}\n"
                f"call: %json {schema}\n"
            )
        schema = calls_schema(forced_functions(tools, choice), "parameters", bind_all=True)
        repeat = ' ("; " call)*' if parallel and not isinstance(choice, NamedToolChoice) else ""
        return f"%llguidance {{}}\nstart: call{repeat}\ncall: %json {schema}\n"

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "You have access to the following functions:\n"
            f"{tool_list(tools)}\n\n"
            "To call a function, respond only with a JSON object of the form "
            '{"name": <function-name>, "parameters": <args-json-object>} and nothing else. '
            "Otherwise answer in plain text."
        )
        return ToolPrompt(section, "", "", "parameters", "Function result:\n", "")


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, Qwen3CoderToolParser,
    DeepSeekV3ToolParser, HarmonyToolParser)}
