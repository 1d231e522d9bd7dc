"""Tool-call parsers (serve_app/output/tool_parsers.py): whole texts, the same texts streamed
in every split (arguments piece by piece, adding up to the whole), malformed output returned
as content, cut calls never; and the grammars that force calls, checked with llguidance
against the tiny tokenizer."""

from __future__ import annotations

import json

import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher

from serve_app.output.call_deltas import CallDelta, merged
from serve_app.output.json_object_end import ObjectEnd
from serve_app.output.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolOutput,
)
from serve_app.schema.tools import NamedToolChoice, Tool
from tests.support.tool_calls import parse_whole

DELIVERY = Tool.model_validate({"type": "function", "function": {
    "name": "get_delivery_date", "strict": True,
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"], "additionalProperties": False}}})
ADD = Tool.model_validate({"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}})
TOOLS = [DELIVERY, ADD]

# Model outputs in each format (as Qwen 2.5 and Llama 3.1 write them), with the expected
# (content, [(name, arguments)]).
HERMES_OUTPUTS = [
    ('<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_id": "12345"}}\n</tool_call>',
     "", [("get_delivery_date", {"order_id": "12345"})]),
    ('Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_id": "7"}}\n</tool_call>',
     "Let me check.", [("add", {"a": 1, "b": 2}), ("get_delivery_date", {"order_id": "7"})]),
    ("Your order ships on Monday.", "Your order ships on Monday.", []),
    ("a < b and x <tool is fine", "a < b and x <tool is fine", []),
    # parameters instead of arguments, arguments as JSON text: both read
    ('<tool_call>{"name": "add", "parameters": {"a": 3, "b": 4}}</tool_call>', "", [("add", {"a": 3, "b": 4})]),
    ('<tool_call>{"name": "add", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>', "", [("add", {"a": 5, "b": 6})]),
    # cut off before the closing tag, the call complete: still a call
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}', "", [("add", {"a": 1, "b": 1})]),
]
# Recorded from SmolLM2-135M-Instruct (the default model; its template ignores tools, so
# chatserve's hermes section taught it the format), seed 001 request sample 1, greedy, 60
# tokens: with tool_choice "required" (parallel calls allowed) it repeats the call until
# the cap; the cut second call is left out (it once came back as content); under "auto" it
# answers in text.
SMOLLM2_REQUIRED = ('<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_id": "{order_id}"}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "get_delivery_date", "arguments": {"order_')
SMOLLM2_AUTO = ("You can use the `get_delivery_date()` function in the `get_delivery_date()` function call to get the "
                "delivery date for a customer's order.\n\nHere's an example:\n```\ndef get_delivery_date(order_id):\n"
                "    return get_delivery")
HERMES_OUTPUTS += [
    (SMOLLM2_REQUIRED, "", [("get_delivery_date", {"order_id": "{order_id}"})]),
    (SMOLLM2_AUTO, SMOLLM2_AUTO, []),
]
# Closed, but not a call (known before any of it streamed as one): content.
HERMES_MALFORMED = [
    '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',  # unknown function
    '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"nom": "add"}\n</tool_call>',  # not a call object
]
# Cut off inside a call (max_tokens): the markup is never content, the call never a call.
HERMES_CUT = [
    ('<tool_call>\n{"name": "add", "argum', ""),
    ('Let me add. <tool_call>\n{"name": "add", "arguments": {"a": 1, "b"', "Let me add."),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "ad', ""),
    ('<tool_call>\n{"name": "add", "arguments": {"a": "}</tool_c', ""),
]
LLAMA_OUTPUTS = [
    ('{"name": "get_delivery_date", "parameters": {"order_id": "12345"}}', "", [("get_delivery_date", {"order_id": "12345"})]),
    ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": 3, "b": 4}}', "",
     [("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})]),
    ("The delivery date is 2024.09.10.", "The delivery date is 2024.09.10.", []),
    ("  <b>bold</b> text", "  <b>bold</b> text", []),
]
LLAMA_MALFORMED = [
    '{"name": "add", "parameters": {"a": 1',
    '{"name": "nope", "parameters": {}}',
    '{"name": "add", "parameters": {"a": 1}} and then some text',
]


def calls_of(out: ToolOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


def streamed(parser_cls, pieces: list[str], forced: bool = False) -> ToolOutput:
    """The content and the whole calls of a text pushed in `pieces`; checks on the way that
    each call's deltas have OpenAI's shape and add up to its arguments."""
    parser = parser_cls(TOOLS, forced)
    content, deltas = "", []
    for piece in [*pieces, None]:
        out = parser.push(piece) if piece is not None else parser.finish()
        content += out.content
        deltas += out.calls
    check_delta_shapes(deltas)
    return ToolOutput(content, merged(deltas))


def check_delta_shapes(deltas: list[CallDelta]) -> None:
    seen: dict[int, int] = {}
    for delta in deltas:
        first = delta.index not in seen
        assert (delta.id is not None) == first and (delta.name is not None) == first, deltas
        seen[delta.index] = seen.get(delta.index, 0) + 1
    assert sorted(seen) == list(range(len(seen)))  # calls numbered in order, from 0


def splits(text: str):
    """The text in two pieces at every point, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


@pytest.mark.parametrize(("parser_cls", "cases"), [(HermesToolParser, HERMES_OUTPUTS), (Llama3JsonToolParser, LLAMA_OUTPUTS)])
def test_whole_outputs_parse(parser_cls, cases):
    for text, content, calls in cases:
        out = parse_whole(parser_cls, text, TOOLS)
        assert (out.content, calls_of(out)) == (content, calls), text
        assert all(c.id.startswith("call_") and len(c.id) > 10 for c in out.calls)


@pytest.mark.parametrize(("parser_cls", "cases"), [(HermesToolParser, HERMES_OUTPUTS), (Llama3JsonToolParser, LLAMA_OUTPUTS)])
def test_streaming_in_every_split_gives_the_same_answer(parser_cls, cases):
    for text, content, calls in cases:
        for pieces in splits(text):
            out = streamed(parser_cls, pieces)
            assert (out.content, calls_of(out)) == (content, calls), pieces


def test_streaming_token_by_token_with_a_real_tokenizer(tiny_tokenizer):
    for text, content, calls in HERMES_OUTPUTS:
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        pieces = [tiny_tokenizer.decode([i]) for i in ids]
        assert "".join(pieces) == text
        out = streamed(HermesToolParser, pieces)
        assert (out.content, calls_of(out)) == (content, calls)


@pytest.mark.parametrize(("parser_cls", "texts"), [(HermesToolParser, HERMES_MALFORMED), (Llama3JsonToolParser, LLAMA_MALFORMED)])
def test_malformed_calls_come_back_as_content(parser_cls, texts):
    for text in texts:
        assert parse_whole(parser_cls, text, TOOLS) == ToolOutput(text, [])
        for pieces in splits(text):
            out = streamed(parser_cls, pieces)
            assert (out.content, out.calls) == (text, [])


@pytest.mark.parametrize("forced", [False, True])
def test_a_cut_call_is_neither_content_nor_a_call(forced):
    for text, content in HERMES_CUT:
        for pieces in splits(text):
            out = streamed(HermesToolParser, pieces, forced)
            assert out.content == content, pieces
            assert [c.name for c in out.calls] == (["add"] if "</tool_call>" in text else []), pieces


def test_a_closed_call_with_bad_json_arguments_keeps_them_as_written():
    """Once its function is known the call has streamed, so it stays a call; its arguments
    are the model's text (as OpenAI's: validate them). Under a grammar they are valid."""
    text = '<tool_call>\n{"name": "add", "arguments": {"a": 1,, }}\n</tool_call>'
    for pieces in splits(text):
        [call] = streamed(HermesToolParser, pieces).calls
        assert (call.name, call.arguments) == ("add", '{"a": 1,, }')


def test_forced_output_is_never_content():
    closed_but_not_a_call = '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>'
    assert parse_whole(HermesToolParser, closed_but_not_a_call, TOOLS, forced=True) == ToolOutput("", [])
    cut = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "add", "parameters": {"a": '
    for pieces in splits(cut):
        out = streamed(Llama3JsonToolParser, pieces, forced=True)
        assert (out.content, calls_of(out)) == ("", [("add", {"a": 1, "b": 2})]), pieces


def test_arguments_stream_as_written_before_the_call_closes():
    parser = HermesToolParser(TOOLS)
    [head] = parser.push('<tool_call>\n{"name": "add", "arguments": ').calls + parser.push("{").calls
    assert (head.index, head.name, head.arguments) == (0, "add", "{") and head.id.startswith("call_")
    pieces = ['"a": 1', ', "b": "x}<', "/y", '"}', "}\n</tool", "_call>"]
    got = [[(d.index, d.id, d.arguments, d.done) for d in parser.push(p).calls] for p in pieces]
    # A "<" may start the closing tag: held until the next piece shows it does not.
    assert got == [[(0, None, '"a": 1', False)], [(0, None, ', "b": "x}', False)], [(0, None, "</y", False)],
                   [(0, None, '"}', False)], [], [(0, None, "", True)]]


def test_forced_llama_calls_stream_in_every_split():
    text = ('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": {"c": "}; {"}}}; '
            '{"name": "get_delivery_date", "parameters": {"order_id": "7"}}')
    whole = [("add", {"a": 1, "b": {"c": "}; {"}}), ("get_delivery_date", {"order_id": "7"})]
    for pieces in splits(text):
        out = streamed(Llama3JsonToolParser, pieces, forced=True)
        assert (out.content, calls_of(out)) == ("", whole), pieces


@pytest.mark.parametrize("split_at", range(1, 12))
def test_object_end_in_any_split(split_at):
    text = '{"a": "\\"}{", "b": {"c": [1, "\\\\"]}} tail'
    end = ObjectEnd()
    first, rest = text[:split_at], text[split_at:]
    found = end.feed(first)
    assert found is None
    assert split_at + end.feed(rest) == text.index(" tail")


def test_content_before_a_call_streams_before_the_call_completes():
    parser = HermesToolParser(TOOLS)
    assert parser.push("Checking your order").content == "Checking your order"
    assert parser.push(" now <tool").content == " now"  # "<tool" may open a call, " " may precede one: held
    opened = parser.push('_call>{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert opened.content == "" and [(c.name, c.arguments) for c in opened.calls] == [("add", '{"a": 1, "b": 2}')]
    closed = parser.push("</tool_call>")
    assert calls_of(ToolOutput("", merged(opened.calls + closed.calls))) == [("add", {"a": 1, "b": 2})]


def test_a_held_back_tag_prefix_is_released_when_it_is_not_a_tag():
    parser = HermesToolParser(TOOLS)
    assert parser.push("x <tool").content == "x"
    assert parser.push("box").content == " <toolbox"


def test_llama_text_answer_streams_once_it_cannot_be_a_call():
    parser = Llama3JsonToolParser(TOOLS)
    assert parser.push(" ").content == ""  # still undecided
    assert parser.push("Sure").content == " Sure"
    assert parser.push(", done").content == ", done"


# ------------------------------------------------------------------------------ grammars

NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_tokenizer):
    return llguidance.hf.from_tokenizer(tiny_tokenizer)


def accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def hermes(name: str, args: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def llama(name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters": args})


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser])
@pytest.mark.parametrize("choice", ["auto", "required", NAMED_ADD])
@pytest.mark.parametrize("parallel", [True, False])
def test_grammars_are_valid_llguidance(parser_cls, choice, parallel):
    grammar = parser_cls.grammar(TOOLS, choice, parallel)
    assert grammar is not None  # DELIVERY is strict, so auto is constrained too
    assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""  # "" means valid


def test_auto_without_strict_functions_is_unconstrained():
    assert HermesToolParser.grammar([ADD], "auto", True) is None
    assert Llama3JsonToolParser.grammar([ADD], "auto", True) is None


@pytest.mark.parametrize(("parser_cls", "call", "separator"), [(HermesToolParser, hermes, "\n"),
                                                                (Llama3JsonToolParser, llama, "; ")])
def test_required_allows_exactly_valid_calls(parser_cls, call, separator, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, "required", True)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok(call("get_delivery_date", {"order_id": "12345"}))
    assert ok(call("add", {"a": 1, "b": 2}) + separator + call("add", {"a": 3, "b": 4}))
    assert not ok("The answer is 3.")  # a call is required
    assert not ok(call("get_delivery_date", {"order_id": 12345}))  # wrong type
    assert not ok(call("get_delivery_date", {}))  # missing required argument
    assert not ok(call("get_delivery_date", {"order_id": "1", "extra": 1}))  # additionalProperties false
    assert not ok(call("add", {"a": "1", "b": 2}))  # forced: non-strict functions are bound too
    assert not ok(call("launch_rocket", {}))
    single = parser_cls.grammar(TOOLS, "required", False)
    assert not accepts(ll_tokenizer, tiny_tokenizer, single, call("add", {"a": 1, "b": 2}) + separator
                       + call("add", {"a": 3, "b": 4}))


@pytest.mark.parametrize(("parser_cls", "call"), [(HermesToolParser, hermes), (Llama3JsonToolParser, llama)])
def test_named_choice_allows_only_that_function(parser_cls, call, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, NAMED_ADD, True)
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, call("add", {"a": 1, "b": 2}))
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, call("get_delivery_date", {"order_id": "1"}))


@pytest.mark.parametrize(("parser_cls", "call"), [(HermesToolParser, hermes), (Llama3JsonToolParser, llama)])
def test_strict_under_auto_allows_text_or_schema_valid_calls(parser_cls, call, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, "auto", True)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok("Your order ships on Monday.")
    assert ok(call("get_delivery_date", {"order_id": "12345"}))
    assert not ok(call("get_delivery_date", {"order_id": 12345}))  # strict: bound to its schema
    assert ok(call("add", {"a": "x"}))  # not strict: any object
    assert not ok(call("launch_rocket", {}))


def test_hermes_strict_auto_binds_calls_after_text(ll_tokenizer, tiny_tokenizer):
    grammar = HermesToolParser.grammar(TOOLS, "auto", True)
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, "Let me look. " + hermes("get_delivery_date", {"order_id": "9"}))
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, "Let me look. " + hermes("get_delivery_date", {"id": "9"}))


@pytest.mark.parametrize("parser_cls", [HermesToolParser, Llama3JsonToolParser])
def test_what_the_grammar_forces_the_parser_reads(parser_cls, ll_tokenizer, tiny_tokenizer):
    """Walk the forced grammar with the tokens of a call and parse the result: the grammar
    and the parser agree on the format."""
    grammar = parser_cls.grammar([DELIVERY], "required", False)
    text = (hermes if parser_cls is HermesToolParser else llama)("get_delivery_date", {"order_id": "12345"})
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, text)
    assert calls_of(parse_whole(parser_cls, text, [DELIVERY])) == [("get_delivery_date", {"order_id": "12345"})]


def test_schemas_with_definitions_keep_their_references(ll_tokenizer, tiny_tokenizer):
    """Pydantic-made parameters hold `$defs` and `#/$defs/...` refs relative to their own
    root; inside the call schema they must still resolve (also with several tools)."""
    item = {"type": "object", "properties": {"sku": {"type": "string", "maxLength": 4}, "next": {"$ref": "#/$defs/Item"}},
            "required": ["sku"], "additionalProperties": False}
    params = {"type": "object", "$defs": {"Item": item}, "properties": {"item": {"$ref": "#/$defs/Item"}},
              "required": ["item"], "additionalProperties": False}
    order = Tool.model_validate({"type": "function", "function": {"name": "order", "parameters": params}})
    for tools in ([order], [ADD, order]):
        grammar = HermesToolParser.grammar(tools, "required", False)
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""
        ok = lambda args: accepts(ll_tokenizer, tiny_tokenizer, grammar, hermes("order", args))  # noqa: E731
        assert ok({"item": {"sku": "ab", "next": {"sku": "c"}}})
        assert not ok({"item": {"sku": "ab", "next": {"id": 3}}})


@pytest.mark.parametrize(("parser_cls", "call", "separator"), [(HermesToolParser, hermes, "\n"),
                                                                (Llama3JsonToolParser, llama, "; ")])
def test_strict_auto_without_parallel_calls_allows_at_most_one(parser_cls, call, separator, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, "auto", False)
    one = call("get_delivery_date", {"order_id": "1"})
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, one)
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, "No call needed.")
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, one + separator + one)
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, call("get_delivery_date", {"order_id": 1}))
