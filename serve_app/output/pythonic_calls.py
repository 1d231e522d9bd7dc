"""Pythonic tool calls (`tool_call_parser: pythonic`: Llama 3.2, Llama 4, ToolACE): the
whole answer is a Python list of calls with keyword arguments,
`[get_weather(city="Paris"), add(a=1, b=2)]`, Llama 4 wrapping it in `<|python_start|>`
and `<|python_end|>`.

Arguments are literals (strings, numbers, True/False/None, lists, dicts) and become a
JSON object; `true`, `false` and `null` are read too (the grammar writes values as JSON).
Positional arguments, `**kwargs` and expressions make the element no call.

Streaming: a call is sent whole, id, name and all its arguments in one delta, when its
closing parenthesis arrives: the JSON is not known before the Python is (`'a'` becomes
`"a"`, `True` `true`), and nothing reads half a literal. Under `auto` the answer is calls
when it starts as one (`[`, a known function, `(`) and its first element parses; if that
element is no call the whole answer is content (as llama3_json's). A later element that
is no call is left out, as is a call the output cuts off once one was sent; text after
the list is content.

Grammar: each function's declared arguments as keywords in the schema's order (required
ones always, optional ones at will) with JSON values bound to their schemas. Arguments
whose names are not Python identifiers cannot be written: if required, the request is
refused (400), as is a parameters schema that constrains the object as a whole.
"""

from __future__ import annotations

import ast
import json
import keyword
import math
import re
import warnings
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import new_call_id
from serve_app.output.json_object_end import BalancedEnd
from serve_app.output.tool_parser_base import (
    ToolOutput,
    ToolParser,
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

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
# The answer's start up to the parenthesis of its first call; what may still become one.
_HEAD = re.compile(r"\[\s*([A-Za-z0-9_-]*)\s*(\()?")
_HEAD_LIMIT = 256
_CALL_NAME = re.compile(r"\s*([A-Za-z0-9_-]{1,64})\s*\(")  # function names may hold "-"
_LITERAL_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _element_end() -> BalancedEnd:
    """Where one element of the list ends: past the parenthesis that closes its call, or
    at a stray closing bracket (the list's own `]`); brackets in string literals skipped."""
    return BalancedEnd("([{", ")]}", "'\"", stray_ends=True)


def _literal(node: ast.expr) -> Any:
    """A JSON value of a literal's syntax tree; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, bool, int, float))):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ValueError("not a JSON number")
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERAL_NAMES:
        return _LITERAL_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("a sign before a non-number")
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if not all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
            raise ValueError("dict keys must be strings")
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


def pythonic_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call written in Python, or None if it is not one."""
    head = _CALL_NAME.match(text)
    if head is None or head.group(1) not in names:
        return None
    try:
        with warnings.catch_warnings():  # a model's "\d" is an invalid escape, not our warning
            warnings.simplefilter("ignore")
            # The name is replaced: a function named "get-time" is not a Python name.
            node = ast.parse("f" + text[head.end() - 1:].strip(), mode="eval").body
        if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args
                or any(k.arg is None for k in node.keywords)):
            return None
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    return head.group(1), json.dumps(arguments, ensure_ascii=False)


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self._state = "start"  # start -> text, or element <-> between -> after
        self._buffer = ""  # undecided text (the head; between elements; after the list)
        self._raw = ""  # all the text, until a call is sent: the answer if it is no calls
        self._parts: list[str] = []  # the current element's text
        self._end = _element_end()

    def push(self, text: str) -> ToolOutput:
        out = ToolOutput()
        if self._state != "text" and not self.made_calls:
            self._raw += text
        rest: str | None = text
        while rest is not None:
            rest = getattr(self, "_" + self._state)(rest, out)
        return self._checked(out)

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._state == "after":
            tail = self._buffer.lstrip().removeprefix(PYTHON_END)
            out.content = tail if tail.strip() else ""
        elif self._state != "text" and not self.made_calls:
            out.content = self._raw  # undecided, or cut before a call was sent: text (like llama3_json)
        self._state, self._buffer = "text", ""
        return self._checked(out)

    def _text(self, text: str, out: ToolOutput) -> None:
        out.content += text

    def _start(self, text: str, out: ToolOutput) -> str | None:
        """Wait until the answer's start shows whether it is a list of calls."""
        self._buffer += text
        head = self._buffer.lstrip()
        if head.startswith(PYTHON_START):
            head = head[len(PYTHON_START):].lstrip()
        if not head or PYTHON_START.startswith(head):
            return None
        found = _HEAD.match(head)
        if found is not None and found.group(2) and found.group(1) in self.names:
            self._state, self._buffer = "element", ""
            return head[found.start(1):]
        if found is None or found.group(2) or found.end() < len(head) or len(head) > _HEAD_LIMIT:
            self._state, self._buffer = "text", ""
            out.content += self._raw
        return None

    def _element(self, text: str, out: ToolOutput) -> str | None:
        end = self._end.feed(text)
        if end is None:
            self._parts.append(text)
            return None
        element = "".join(self._parts) + text[:end]
        self._parts, self._end, self._state = [], _element_end(), "between"
        call = pythonic_call(element, self.names)
        if call is not None:
            out.calls.append(CallDelta(self._next_index(), call[1], new_call_id(), call[0], done=True))
        elif not self.made_calls and not self.forced:  # the first element is no call: all text
            self._state = "text"
            out.content += self._raw
            return None
        return text[end:]

    def _between(self, text: str, out: ToolOutput) -> str | None:
        self._buffer += text
        head = self._buffer.lstrip()
        if not head:
            return None
        self._buffer = ""
        if head[0] == ",":
            self._state = "element"
            return head[1:]
        self._state = "after"
        return head[1:] if head[0] == "]" else head  # the list is over (or broke off)

    def _after(self, text: str, out: ToolOutput) -> None:
        self._buffer += text  # text after the list: content at the end, unless only markup

    @classmethod
    def grammar(cls, tools: list[Tool], choice: Any, parallel: bool) -> str | None:
        picked = grammar_functions(tools, choice)
        if picked is None:
            return None
        functions, bind_all = picked
        calls = '"[" call' + (' (", " call)*' if repeats(choice, parallel) else "") + ' "]"'
        rules = ["call: " + function_alternatives(functions)]
        for i, function in enumerate(functions):
            rules += _function_rules(function, f"fn_{i}", bind_all or bool(function.strict))
        if bind_all:
            top = [f"start: {calls}"]
        else:  # text that cannot be taken for calls, or calls whose arguments are bound
            top = [f"start: TEXT | {calls}", "TEXT: /[ \\t\\n]*([^\\[ \\t\\n<](.|\\n)*)?/"]
        return "%llguidance {}\n" + "\n".join(top + rules) + "\n"

    @classmethod
    def tool_prompt(cls, tools: list[Tool]) -> ToolPrompt:
        section = (
            "You have access to the following functions:\n"
            f"{tool_list(tools)}\n\n"
            "To call functions, respond only with a Python list of calls with keyword arguments, "
            "[func_name1(param1=value1, param2=value2), func_name2(param=value)], and nothing else. "
            "Otherwise answer in plain text."
        )
        # Earlier calls can only be written as JSON objects (ToolPrompt's one call shape).
        return ToolPrompt(section, "", "", "arguments", "Function result:\n", "")


def _function_rules(function: FunctionDefinition, rule: str, bound: bool) -> list[str]:
    """`rule`: a call of `function`, its keyword arguments bound to their schemas or free."""
    if not bound:
        return [f"{rule}: {lit(function.name + '(')} ({rule}_kw ({lit(', ')} {rule}_kw)*)? \")\"",
                f"{rule}_kw: /[A-Za-z_][A-Za-z0-9_]*=/ {json_value({})}"]
    props, problem = properties_of(function)
    items = []
    for name, schema, required in props:
        if name.isidentifier() and not keyword.iskeyword(name):
            items.append((f"{lit(name + '=')} {json_value(schema)}", required))
        elif required:
            problem = f"{function.name} requires {name!r}, not a Python keyword argument"
    if problem is not None:
        return [f"{rule}: {unenforceable(problem + ' in pythonic calls')}"]
    arguments, more = in_order(items, ", ", f"{rule}_a")
    return [f"{rule}: {lit(function.name + '(')} {arguments} \")\"", *more]
