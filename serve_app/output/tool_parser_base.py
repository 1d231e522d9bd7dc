"""What every tool-call format shares: the `ToolParser` interface, the JSON schemas and Lark
pieces its grammar is built from, and the readers of call markup that arrives in pieces.

The formats themselves live in serve_app/output/tool_parsers.py (hermes, llama3_json, and
the registry `PARSERS`), mistral_calls.py, pythonic_calls.py, xml_calls.py (qwen3_coder)
and deepseek_calls.py.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from serve_app.output.call_deltas import CallDelta
from serve_app.output.call_reader import CallReader
from serve_app.output.json_object_end import ObjectEnd
from serve_app.output.tags import held_prefix
from serve_app.schema.tools import FunctionDefinition, NamedToolChoice, Tool
from workers.contract.requests import ToolPrompt

WS = r"/[ \t\n]*/"  # a Lark lexeme: optional whitespace
# Compact JSON as models write it; flexible whitespace would let a model pad forever.
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass
class ToolOutput:
    """What one piece of model text turned into."""

    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser(ABC):
    """One format. An instance parses one choice's output as it streams; `parse` reads a
    whole text; the class methods build the format's grammar and prompt section."""

    name: str = ""
    # The format's tags are special tokens of its models' tokenizers: with tools in play the
    # output is decoded with them (skip_special_tokens false), or the parser never sees a call.
    special_tags: bool = False
    arguments_key: str = "arguments"
    arguments_keys: tuple[str, ...] = ("arguments", "parameters")  # read, in this order

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        """`forced`: the grammar forces the output to be calls (`tool_choice` required or
        named), so no text of it is ever content."""
        self.names = {t.function.name for t in tools}
        self.forced = forced
        self.made_calls = False
        self._num_calls = 0

    def _next_index(self) -> int:
        self._num_calls += 1
        self.made_calls = True
        return self._num_calls - 1

    def _reader(self) -> CallReader:
        return CallReader(self.names, self.arguments_keys, self._next_index)

    def _checked(self, out: ToolOutput) -> ToolOutput:
        if self.forced:  # the grammar made the output calls: text in it is never content
            out.content = ""
        return out

    @abstractmethod
    def push(self, text: str) -> ToolOutput:
        """The content and calls this piece of text completes; the rest is held back."""

    @abstractmethod
    def finish(self) -> ToolOutput:
        """Everything still held back, at the end of the output."""

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


def grammar_functions(tools: list[Tool], choice: Any) -> tuple[list[FunctionDefinition], bool] | None:
    """The functions a grammar offers and whether all their arguments are bound (forced);
    None when `auto` has no strict function, so the output stays free."""
    if choice != "auto":
        return forced_functions(tools, choice), True
    if not any(t.function.strict for t in tools):
        return None
    return [t.function for t in tools], False


def repeats(choice: Any, parallel: bool) -> bool:
    """Whether the grammar allows several calls (never for a named function)."""
    return parallel and not isinstance(choice, NamedToolChoice)


# ------------------------------------------------------------------- schemas and Lark


def call_schema(function: FunctionDefinition, arguments_key: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, arguments_key: arguments},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def calls_schema(functions: list[FunctionDefinition], arguments_key: str, bind_all: bool) -> str:
    """One JSON schema for a call to any of `functions` (llguidance wants anyOf, not rule
    alternatives); arguments are bound to the function's schema when forced or strict."""
    options, defs = [], {}
    for i, function in enumerate(functions):
        arguments: dict[str, Any] = {"type": "object"}
        if bind_all or function.strict:
            location = f"#/properties/{arguments_key}" if len(functions) == 1 else f"#/anyOf/{i}/properties/{arguments_key}"
            arguments, own_defs = relocated(function.arguments_schema, location, f"f{i}_")
            defs.update(own_defs)
        options.append(call_schema(function, arguments_key, arguments))
    schema = dict(options[0]) if len(options) == 1 else {"anyOf": options}
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = COMPACT
    return json.dumps(schema, ensure_ascii=False)


def relocated(schema: dict[str, Any], location: str, prefix: str) -> tuple[dict[str, Any], dict[str, Any]]:
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


def function_alternatives(functions: list[FunctionDefinition]) -> str:
    """The Lark alternatives `fn_0 | fn_1 | ...`, one rule per function (each format writes
    its own `fn_i` rules)."""
    return " | ".join(f"fn_{i}" for i in range(len(functions)))


def lit(text: str) -> str:
    """`text` as a Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def tagged_calls_grammar(open_tag: str, rules: list[str], bind_all: bool) -> str:
    """A format whose calls follow `open_tag` (rules define `calls`): forced, the output is
    the tag and calls; else free text, in which writing the tag (a lazy trigger) commits the
    model to valid calls."""
    if bind_all:
        top = [f"start: {lit(open_tag)} calls"]
    else:
        top = ["start: TEXT | trigger calls", "TEXT: /(.|\\n)*/", f"trigger[lazy]: TEXT {lit(open_tag)}"]
    return "%llguidance {}\n" + "\n".join(top + rules) + "\n"


def json_value(schema: dict[str, Any]) -> str:
    """A Lark `%json` item for `schema`, written compactly."""
    return "%json " + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)


def arguments_json(function: FunctionDefinition, bound: bool) -> str:
    """The `%json` item of a function's arguments object, written alone (formats that put
    the name outside the JSON): its schema when bound, else any object."""
    return json_value(function.arguments_schema if bound else {"type": "object"})


def unenforceable(reason: str) -> str:
    """A Lark item llguidance refuses with `reason` in its message: for a schema a format
    cannot write, so that the request gets a 400 naming the cause (`unsupported_schema`)
    rather than calls the grammar does not guarantee."""
    return "%json " + json.dumps({"type": f"cannot enforce: {reason}"})


# Keywords of a parameters schema that formats writing one argument at a time (pythonic,
# qwen3_coder) can honour: they only describe the declared properties, which the grammar
# writes one by one, never any other.
_PER_PROPERTY_KEYWORDS = {"type", "properties", "required", "additionalProperties", "patternProperties",
                          "propertyNames", "unevaluatedProperties", "description", "title", "$defs", "definitions",
                          "$schema", "$id", "$comment", "examples", "default"}


def properties_of(function: FunctionDefinition) -> tuple[list[tuple[str, dict[str, Any], bool]], str | None]:
    """The declared arguments of a function as (name, schema, required), each schema with the
    parameters' definitions (so its `$ref`s resolve alone); or why they cannot be written one
    by one (a keyword that constrains the object as a whole)."""
    schema = function.arguments_schema
    extra = sorted(set(schema) - _PER_PROPERTY_KEYWORDS)
    if extra or schema.get("type", "object") != "object":
        return [], f"the parameters of {function.name} constrain the object as a whole ({', '.join(extra) or 'type'})"
    required = set(schema.get("required") or [])
    defs = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    props = [(name, {**sub, **defs} if isinstance(sub, dict) else sub, name in required)
             for name, sub in (schema.get("properties") or {}).items()]
    missing = required - {name for name, _, _ in props}
    if missing:
        return [], f"{function.name} requires undeclared arguments ({', '.join(sorted(missing))})"
    return props, None


def in_order(items: list[tuple[str, bool]], separator: str, prefix: str) -> tuple[str, list[str]]:
    """A Lark expression for `items` (expression, required) written in their order, each
    optional one left out at will, `separator` between two; and the rules it needs. Linear
    in the items: rule `{prefix}_k` is "the items from k on, after one already written".
    The expression matches the empty text when no item is required (it is "" for none)."""
    rules, n = [], len(items)
    for k in range(n - 1, 0, -1):
        expr, required = items[k]
        part = f"({lit(separator)} {expr})" if separator else f"({expr})"
        tail = f" {prefix}_{k + 1}" if k + 1 < n else ""
        rules.append(f"{prefix}_{k}: {part}{'' if required else '?'}{tail}")
    alternatives = []
    for k, (expr, required) in enumerate(items):
        alternatives.append(expr + (f" {prefix}_{k + 1}" if k + 1 < n else ""))
        if required:
            break
    else:  # nothing required: no item at all is allowed too
        return (f"({' | '.join(alternatives)})?" if alternatives else ""), rules
    return f"({' | '.join(alternatives)})", rules


def tool_list(tools: list[Tool]) -> str:
    return "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)


# ------------------------------------------------------------- reading markup in pieces


class ArgumentsText:
    """An arguments object whose function was named before it (`name{...}`, DeepSeek's
    fenced JSON): its text passes through as written up to its closing brace. Fed text
    that starts with `{`."""

    def __init__(self) -> None:
        self._end = ObjectEnd()
        self.rest: str | None = None  # the text after the closing brace, once seen

    def push(self, text: str) -> str:
        """The part of `text` that belongs to the arguments."""
        end = self._end.feed(text)
        if end is None:
            return text
        self.rest = text[end:]
        return text[:end]


class Head:
    """The start of a call up to (and including) `delimiter`, read in pieces, then matched
    whole against `pattern`. It is dead early when the text after the leading whitespace
    cannot begin with `lead`, when the text so far does not match `viable` (a pattern every
    prefix of a head matches), or past `limit` characters (a head is short: so is the text
    held back while it is undecided)."""

    def __init__(self, pattern: re.Pattern[str], delimiter: str, lead: str = "",
                 viable: re.Pattern[str] | None = None, limit: int = 256) -> None:
        self._pattern, self._delimiter, self._lead = pattern, delimiter, lead
        self._viable, self._limit = viable, limit
        self.text = ""
        self.dead = False
        self.match: re.Match[str] | None = None
        self.rest = ""  # the text after the delimiter, once decided

    def push(self, piece: str) -> bool:
        """Take a piece; True once the head is decided (`match` set, or `dead`)."""
        end = piece.find(self._delimiter)
        before = self.text + (piece if end < 0 else piece[:end])
        self.text = before if end < 0 else before + self._delimiter
        self.rest = "" if end < 0 else piece[end + len(self._delimiter):]
        start = before.lstrip()[: len(self._lead)]
        if (not self._lead.startswith(start) or len(self.text) > self._limit
                or (self._viable is not None and self._viable.fullmatch(before) is None)):
            self.dead = True
            return True
        if end < 0:
            return False
        self.match = self._pattern.fullmatch(self.text)
        self.dead = self.match is None
        return True


def find_first(text: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The first of `tags` in `text` from `start`: (its index, the tag); else (the index
    from which text may still begin a tag, None)."""
    best, found = -1, None
    for tag in tags:
        i = text.find(tag, start)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, tag
    if found is not None:
        return best, found
    return len(text) - max(held_prefix(text, tag) for tag in tags), None


def expect(text: str, tags: tuple[str, ...]) -> tuple[str | None, bool]:
    """Which of `tags` `text` starts with after whitespace: (the tag, True); (None, True)
    while it may still be one; (None, False) when it cannot be."""
    head = text.lstrip()
    for tag in tags:
        if head.startswith(tag):
            return tag, True
    return None, any(tag.startswith(head) for tag in tags)


@dataclass
class BodyStep:
    """What the markup after an opening tag made of a piece of text."""

    calls: list[CallDelta] = field(default_factory=list)
    rest: str | None = None  # the markup ended: the text after it, read as text again
    rejected: str | None = None  # not calls after all (nothing announced): everything it read


class CallsBody(ABC):
    """The markup that follows a format's opening tag: one call or several."""

    @abstractmethod
    def push(self, text: str) -> BodyStep: ...

    def finish(self) -> list[CallDelta]:
        """The output ended inside the markup: what that completes (calls whose arguments
        closed were done when they closed; a cut one is left out)."""
        return []


class TaggedToolParser(ToolParser):
    """Formats whose calls start at an opening tag anywhere in the text, markup a
    `CallsBody` reads: the text before it is content (whitespace just before a call is
    not), text after the calls is content, whitespace after the last call is dropped.
    Markup that turns out not to be a call before any call was announced is content; a
    call cut off is neither content nor a call. Forced calls: nothing is content."""

    OPEN = ""

    def __init__(self, tools: list[Tool], forced: bool = False) -> None:
        super().__init__(tools, forced)
        self._buffer = ""  # text not yet emitted: a possible tag prefix, trailing whitespace
        self._gap = ""  # the whitespace dropped before the open tag (content again if it is no call)
        self._body: CallsBody | None = None

    @abstractmethod
    def _new_body(self) -> CallsBody: ...

    def push(self, text: str) -> ToolOutput:
        out = ToolOutput()
        while True:
            if self._body is None:
                text = self._read_text(text, out)
                if text is None:
                    return self._checked(out)
            step = self._body.push(text)
            out.calls += step.calls
            if step.rejected is not None:  # read again as text, the tag itself content
                self._body, text = None, step.rejected
                out.content += self._gap + self.OPEN
                continue
            if step.rest is None:
                return self._checked(out)
            self._body, text = None, step.rest

    def finish(self) -> ToolOutput:
        out = ToolOutput()
        if self._body is not None:
            out.calls += self._body.finish()
            self._body = None
        elif self._buffer.strip() or not self.made_calls:
            out.content += self._buffer
        self._buffer = ""
        return self._checked(out)

    def _read_text(self, text: str, out: ToolOutput) -> str | None:
        """Emit the text before an opening tag; the text after it (a body begins), or None."""
        self._buffer += text
        start = self._buffer.find(self.OPEN)
        if start < 0:
            # Hold what may start the tag; trailing whitespace waits too: before a call or
            # after the last one it is dropped, else it is content.
            held = held_prefix(self._buffer, self.OPEN)
            kept = self._buffer[: len(self._buffer) - held].rstrip()
            out.content += kept
            self._buffer = self._buffer[len(kept):]
            return None
        before = self._buffer[:start]
        out.content += before.rstrip()
        self._gap = before[len(before.rstrip()):]
        rest, self._buffer = self._buffer[start + len(self.OPEN):], ""
        self._body = self._new_body()
        return rest
