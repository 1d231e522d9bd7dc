"""Qwen3-Coder's XML tool calls (`tool_call_parser: qwen3_coder`):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text (one newline after its tag and one before the closing tag
are markup). It becomes JSON by the function's schema, as the family's template writes
it: a string parameter stays the text; other types are parsed as JSON (`True`, `False`
and `None`, as Python writes them, too), a text that does not parse staying a string;
a parameter the schema does not type is a string.

Streaming: the call is announced at `<function=name>` with `{`; each parameter goes out
as `"name": value` when its closing tag arrives (a value's JSON is known only then), and
`}` at `</function>`, which makes the call whole. Text around calls is content; markup
that is not a call, found before a call was announced, is content.

Grammar: parameters in the schema's declared order, required ones always; a string's
raw text bound by `enum`, `const`, `minLength` and `maxLength` (and `"null"` left out
for type `["string", "null"]`), other values as JSON bound to their schemas. A string
with `pattern` or `format`, another mix of string and other types, or a schema that
constrains the object as a whole cannot be written: the request is refused (400).
"""

from __future__ import annotations

import json
import re
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import new_call_id
from serve_app.output.tool_parser_base import (
    BodyStep,
    CallsBody,
    Head,
    TaggedToolParser,
    expect,
    find_first,
    function_alternatives,
    grammar_functions,
    in_order,
    json_value,
    lit,
    properties_of,
    repeats,
    tool_list,
    unenforceable,
)
from serve_app.schema.tools import FunctionDefinition, Tool
from workers.contract.requests import ToolPrompt

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_FUNCTION_HEAD = re.compile(r"\s*<function=([A-Za-z0-9_-]{1,64})>")
_VALUE_ENDS = (PARAMETER_END, FUNCTION_END, PARAMETER)  # a value missing its closing tag ends too
_NAME_LIMIT = 256
_PYTHON_NAMES = {"True": True, "False": False, "None": None}
_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null", list: "array",
               dict: "object"}


def _types(schema: Any, root: dict[str, Any]) -> set[str]:
    """The JSON types a parameter's schema names (`type`, a local `$ref`, `enum`/`const`
    values, `anyOf`/`oneOf` members); empty when it names none."""
    if not isinstance(schema, dict):
        return set()
    ref = schema.get("$ref")
    if isinstance(ref, str):
        for key in ("#/$defs/", "#/definitions/"):
            if ref.startswith(key):
                return _types((root.get(key[2:-1]) or {}).get(ref[len(key):]), root)
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if isinstance(values, list):
        return {_JSON_TYPES.get(type(v), "string") for v in values}
    return {t for key in ("anyOf", "oneOf") for member in schema.get(key) or [] for t in _types(member, root)}


def parameter_value(text: str, schema: Any, root: dict[str, Any]) -> Any:
    """A parameter's raw text as the JSON value its schema calls for."""
    types = _types(schema, root)
    if not types or types == {"string"}:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        value = _PYTHON_NAMES.get(text.strip(), text)
    kind = _JSON_TYPES.get(type(value), "string")
    if "string" in types and (kind == "string" or not (kind in types or (kind == "integer" and "number" in types))):
        return text  # a string parameter's text, though it may read as JSON
    return value


class _XmlBody(CallsBody):
    """What follows one `<tool_call>`: a function and its parameters (or several), then
    `</tool_call>`."""

    def __init__(self, parser: Qwen3CoderToolParser) -> None:
        self._parser = parser
        self._state = "function"  # function -> params <-> value -> after (-> function), or skip
        self._head = Head(_FUNCTION_HEAD, ">", lead=FUNCTION)
        self._raw = ""  # what it read before the call was announced (given back if no call)
        self._buffer = ""
        self._scanned = 0  # how far the value buffer is known to hold no closing tag
        self._index = -1
        self._root: dict[str, Any] = {}  # the function's parameters schema
        self._parameter = ""  # the name of the one being read
        self._first = True

    def push(self, text: str) -> BodyStep:
        if self._index < 0:  # nothing announced yet
            self._raw += text
        step = BodyStep()
        rest: str | None = text
        while rest is not None and step.rest is None and step.rejected is None:
            rest = getattr(self, "_" + self._state)(rest, step)
        return step

    def _function(self, text: str, step: BodyStep) -> str | None:
        if not self._head.push(text):
            return None
        name = self._head.match.group(1) if self._head.match else None
        if name not in self._parser.names:
            if self._index < 0:  # no call at all: the markup is text
                step.rejected = self._raw
                return None
            self._state = "skip"  # a second function in the tool call, no call: skipped
            return self._head.rest if self._head.match else self._head.text + self._head.rest
        self._index, self._first = self._parser._next_index(), True
        self._root = self._parser.functions[name].arguments_schema
        step.calls.append(CallDelta(self._index, "{", new_call_id(), name))
        self._state = "params"
        return self._head.rest

    def _params(self, text: str, step: BodyStep) -> str | None:
        self._buffer += text
        tag, possible = expect(self._buffer, (PARAMETER, FUNCTION_END))
        head = self._buffer.lstrip()
        if tag == FUNCTION_END:
            step.calls.append(CallDelta(self._index, "}", done=True))
            self._state, self._buffer = "after", ""
            return head[len(FUNCTION_END):]
        if tag == PARAMETER:
            close = head.find(">")
            if close < 0 and len(head) <= _NAME_LIMIT:
                return None
            if close >= 0:
                self._parameter, self._state, self._buffer, self._scanned = head[len(PARAMETER):close], "value", "", 0
                return head[close + 1:]
            possible = False
        if not possible:  # not the markup of a call: the call stays unfinished
            self._state, self._buffer = "skip", ""
            return head
        return None

    def _value(self, text: str, step: BodyStep) -> str | None:
        self._buffer += text
        at, tag = find_first(self._buffer, _VALUE_ENDS, self._scanned)
        if tag is None:
            self._scanned = at
            return None
        raw = self._buffer[:at].removeprefix("\n").removesuffix("\n")
        value = parameter_value(raw, (self._root.get("properties") or {}).get(self._parameter), self._root)
        piece = json.dumps(self._parameter, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)
        step.calls.append(CallDelta(self._index, piece if self._first else ", " + piece))
        self._first, self._state = False, "params"
        rest, self._buffer = self._buffer[at + len(tag):] if tag == PARAMETER_END else self._buffer[at:], ""
        return rest

    def _after(self, text: str, step: BodyStep) -> str | None:
        self._buffer += text
        tag, possible = expect(self._buffer, (CLOSE, FUNCTION))
        head = self._buffer.lstrip()
        if tag == CLOSE:
            step.rest = head[len(CLOSE):]
        elif tag == FUNCTION:  # another function in the same tool call
            self._state, self._buffer, self._head = "function", "", Head(_FUNCTION_HEAD, ">", lead=FUNCTION)
            return head
        elif not possible:  # no closing tag: the call stands, what follows is text
            step.rest = self._buffer
        return None

    def _skip(self, text: str, step: BodyStep) -> None:
        """A broken call: its markup up to `</tool_call>` is neither content nor a call."""
        self._buffer += text
        at, tag = find_first(self._buffer, (CLOSE,))
        if tag is None:
            self._buffer = self._buffer[at:]  # only what may begin the tag
            return None
        step.rest = self._buffer[at + len(CLOSE):]
        return None


class Qwen3CoderToolParser(TaggedToolParser):
    name = "qwen3_coder"
    OPEN = OPEN

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self.functions = {t.function.name: t.function for t in tools}

    def _new_body(self) -> CallsBody:
        return _XmlBody(self)

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        picked = grammar_functions(tools, choice)
        if picked is None:
            return None
        functions, bind_all = picked
        rules = [f"body: \"\\n\" ({function_alternatives(functions)}) {lit(CLOSE)}"]
        for i, function in enumerate(functions):
            rules += _function_rules(function, f"fn_{i}", bind_all or bool(function.strict))
        if bind_all:
            more = ' ("\\n" call)*' if repeats(choice, parallel) else ""
            top = [f"start: call{more}", f"call: {lit(OPEN)} body"]
        else:  # free text; once the model opens a call (a lazy trigger) it must be valid
            top = ["start: call* TEXT" if parallel else "start: TEXT | call", "TEXT: /(.|\\n)*/",
                   f"trigger[lazy]: TEXT {lit(OPEN)}", "call: trigger body"]
        return "%llguidance {}\n" + "\n".join(top + rules + _VALUE_TOKENS) + "\n"

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            f"# Tools\n\nYou have access to the following functions:\n\n<tools>\n{tool_list(tools)}\n</tools>\n\n"
            "To call a function, reply in the following format:\n\n"
            f"{OPEN}\n{FUNCTION}example_function_name>\n{PARAMETER}example_parameter>\nvalue\n{PARAMETER_END}\n"
            f"{FUNCTION_END}\n{CLOSE}\n\nString values are written as they are, other values as JSON."
        )
        # Earlier calls can only be written as JSON objects (ToolPrompt's one call shape).
        return ToolPrompt(section, "", "", "arguments", "<tool_response>\n", "\n</tool_response>")


# Raw text up to the closing tag, holding no tag the parser would stop at, as one lexeme:
# llguidance lexes greedily, so text and closing tag in two lexemes would never end.
_TEXT = r"(.|\n)"
_NO_TAG = r"~/(.|\n)*(<\/parameter>|<\/function>|<parameter=)(.|\n)*\n<\/parameter>/"
_VALUE_TOKENS = [f"ANY_VALUE: /{_TEXT}*\\n<\\/parameter>/ & {_NO_TAG}"]


def _string_value(schema: dict[str, Any], nullable: bool) -> tuple[str, bool] | None:
    """Lark for a string parameter's raw text with its closing tag, and whether it is a
    token's definition (else literal alternatives); None if the schema asks more than this
    format can hold the text to."""
    if set(schema) - {"type", "enum", "const", "minLength", "maxLength", "description", "title", "default",
                      "examples", "$defs", "definitions"}:
        return None
    values = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if values is not None:
        if not all(isinstance(v, str) for v in values):
            return None
        return "(" + " | ".join(lit(v + "\n" + PARAMETER_END) for v in values) + ")", False
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    count = "*" if not low and high is None else f"{{{low},{'' if high is None else high}}}"
    token = f"/{_TEXT}{count}\\n<\\/parameter>/ & {_NO_TAG}"
    if nullable:  # the text "null" would be read as null
        token += " & ~/null\\n<\\/parameter>/"
    return token, True


def _parameter_item(name: str, schema: Any, token: str) -> tuple[str | None, list[str]]:
    """The Lark item of one parameter block (None if it cannot be written), and the token
    definitions it needs."""
    opening = lit(f"{PARAMETER}{name}>\n")
    if not isinstance(schema, dict):
        return (f"{opening} ANY_VALUE \"\\n\"" if schema is True else None), []
    declared = schema.get("type")
    types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else set()
    if "string" in types or (not types and _types(schema, {}) == {"string"} and "enum" in schema):
        value = None if types - {"string", "null"} else _string_value(schema, "null" in types)
        if value is None:
            return None, []
        text, is_token = value
        tokens = [f"{token}: {text}"] if is_token else []
        text = token if is_token else text
        if "null" in types:  # null is written as the text null
            text = f"({text} | {lit('null' + chr(10) + PARAMETER_END)})"
        return f"{opening} {text} \"\\n\"", tokens
    if not types or any(key in schema for key in ("anyOf", "oneOf", "allOf", "$ref", "not", "if")):
        return None, []  # it might be a string, written raw, or JSON: the parser could not tell
    return f"{opening} {json_value(schema)} {lit(chr(10) + PARAMETER_END + chr(10))}", []


def _function_rules(function: FunctionDefinition, rule: str, bound: bool) -> list[str]:
    """`rule`: one function's markup, its parameters bound to their schemas or free."""
    opening, closing = lit(f"{FUNCTION}{function.name}>\n"), lit(FUNCTION_END + "\n")
    if not bound:
        return [f"{rule}: {opening} {rule}_p* {closing}",
                f"{rule}_p: /<parameter=[A-Za-z0-9_-]+>\\n/ ANY_VALUE \"\\n\""]
    props, problem = properties_of(function)
    items, tokens = [], []
    for j, (name, schema, required) in enumerate(props):
        item, more = _parameter_item(name, schema, f"{rule.upper()}_{j}")
        if item is None:
            problem = problem or f"parameter {name!r} of {function.name} cannot be written as qwen3_coder text"
            continue
        items.append((item, required))
        tokens += more
    if problem is not None:
        return [f"{rule}: {unenforceable(problem)}"]
    parameters, more_rules = in_order(items, "", f"{rule}_a")
    return [f"{rule}: {opening} {parameters} {closing}", *more_rules, *tokens]
