"""The model families' tool-call formats (mistral, pythonic, qwen3_coder, deepseek_v3;
serve_app/output/): calls as each family's chat template writes them read back, whole and
streamed in every split (the pieces add up to the whole), text around calls kept, text that
is no call returned as content, cut calls never reported; and each format's grammar,
checked with llguidance against the tiny tokenizer: forced calls (required, named) and
strict arguments, and random walks through the forced grammar that the parser reads as
schema-valid calls."""

from __future__ import annotations

import copy
import json
import random

import jsonschema
import llguidance
import llguidance.hf
import pytest
from llguidance import LLMatcher

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.output.pythonic_calls import pythonic_call
from serve_app.output.tool_parsers import (
    DeepSeekV3ToolParser,
    MistralToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
    ToolOutput,
)
from serve_app.output.xml_calls import parameter_value
from serve_app.schema.tools import NamedToolChoice, Tool
from tests.support.tool_calls import parse_whole, splits, streamed
from tests.unit.api.test_chat_output import accumulate, chunks_of, stream
from workers.contract.grammar import grammar_error
from workers.contract.model_config import ModelConfig
from workers.contract.sampling_params import GuidedDecoding
from workers.text.prompts import PromptBuilder

DELIVERY = Tool.model_validate({"type": "function", "function": {
    "name": "get_delivery_date", "strict": True,
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                   "required": ["order_id"], "additionalProperties": False}}})
ADD = Tool.model_validate({"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}})
TOOLS = [DELIVERY, ADD]
NAMED_ADD = NamedToolChoice.model_validate({"type": "function", "function": {"name": "add"}})

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


# ------------------------------------------------------------------- writing calls


def mistral(calls: list[tuple[str, dict]]) -> str:
    return "[TOOL_CALLS]" + json.dumps([{"name": n, "arguments": a} for n, a in calls])


def mistral_named(calls: list[tuple[str, dict]]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)


def pythonic(calls: list[tuple[str, dict]]) -> str:
    return "[" + ", ".join(f"{n}({', '.join(f'{k}={json.dumps(v)}' for k, v in a.items())})" for n, a in calls) + "]"


def xml(calls: list[tuple[str, dict]], tools: list[Tool] = TOOLS) -> str:
    """Qwen3-Coder's markup: strings raw when the schema says string, everything else JSON."""
    types = {t.function.name: {k: s.get("type") for k, s in t.function.arguments_schema["properties"].items()}
             for t in tools}

    def value(name: str, key: str, v) -> str:
        declared = types.get(name, {}).get(key)
        return v if isinstance(v, str) and "string" in (declared or []) else json.dumps(v)

    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{value(n, k, v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in calls)


def deepseek(calls: list[tuple[str, dict]]) -> str:
    return CALLS_BEGIN + "\n".join(f"{CALL_BEGIN}function{SEP}{n}\n```json\n{json.dumps(a)}\n```{CALL_END}"
                                   for n, a in calls) + CALLS_END


WRITERS = {MistralToolParser: mistral, PythonicToolParser: pythonic, Qwen3CoderToolParser: xml,
           DeepSeekV3ToolParser: deepseek}
FORMATS = list(WRITERS)

# ----------------------------------------------------------------- outputs, per format

TWO = [("add", {"a": 1, "b": 2}), ("get_delivery_date", {"order_id": "7"})]
# (model output, expected content, expected calls)
OUTPUTS = {
    MistralToolParser: [
        (mistral(TWO), "", TWO),
        ("Let me check. " + mistral_named(TWO), "Let me check.", TWO),
        ('[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1, "b": 2}', "", TWO[:1]),
        ('[TOOL_CALLS]add{"a": 1, "b": {"c": "}[TOOL_CALLS]"}}', "", [("add", {"a": 1, "b": {"c": "}[TOOL_CALLS]"}})]),
        ("Your order ships on Monday.", "Your order ships on Monday.", []),
        ("An [INST] tag or [TOOL_CALL is text", "An [INST] tag or [TOOL_CALL is text", []),
        # the list's closing bracket cut off, its call whole: still a call
        ('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}', "", TWO[:1]),
    ],
    PythonicToolParser: [
        (pythonic(TWO), "", TWO),
        ("<|python_start|>[add(a=1, b=-2)]<|python_end|>", "", [("add", {"a": 1, "b": -2})]),
        ("[add(a=True, b=None, c=[1, {'x': 'y'}], d=null, e=(1, 2.5))]", "",
         [("add", {"a": True, "b": None, "c": [1, {"x": "y"}], "d": None, "e": [1, 2.5]})]),
        ('[ get_delivery_date( order_id = "a)],\\"b" ) ]', "", [("get_delivery_date", {"order_id": 'a)],"b'})]),
        ("[1, 2] are numbers", "[1, 2] are numbers", []),
        ("  Sure, [add] it.", "  Sure, [add] it.", []),
        ("[add the numbers]", "[add the numbers]", []),
        ("[add(a=1)] and some text", "and some text", [("add", {"a": 1})]),
        # a later element that is no call is left out; the earlier call stands
        ("[add(a=1), launch_rocket(x=2), add(b=3)]", "", [("add", {"a": 1}), ("add", {"b": 3})]),
    ],
    Qwen3CoderToolParser: [
        (xml(TWO), "", TWO),
        ("Let me add.\n\n" + xml(TWO[:1]) + "\n", "Let me add.", TWO[:1]),
        ("<tool_call>\n<function=get_delivery_date>\n<parameter=order_id>\n\n12 </param> 3\n\n</parameter>\n"
         "</function>\n</tool_call>", "", [("get_delivery_date", {"order_id": "\n12 </param> 3\n"})]),
        # a value whose closing tag is missing ends at the next tag
        ("<tool_call>\n<function=add>\n<parameter=a>\n1\n<parameter=b>\n2\n</function>\n</tool_call>", "", TWO[:1]),
        # a string stays a string though it looks like a number; other types are JSON (or Python's names)
        ("<tool_call>\n<function=get_delivery_date>\n<parameter=order_id>\n12345\n</parameter>\n</function>\n"
         "</tool_call>", "", [("get_delivery_date", {"order_id": "12345"})]),
        ("The answer is <b>3</b>.", "The answer is <b>3</b>.", []),
        ("Done." + xml(TWO[:1]) + " Anything else?", "Done. Anything else?", TWO[:1]),
        # two functions in one tool call
        (xml(TWO).replace("</tool_call>\n<tool_call>\n", ""), "", TWO),
    ],
    DeepSeekV3ToolParser: [
        (deepseek(TWO), "", TWO),
        ("Checking." + deepseek(TWO[:1]), "Checking.", TWO[:1]),
        (f'{CALLS_BEGIN}{CALL_BEGIN}add{SEP}{{"a": 1, "b": 2}}{CALL_END}{CALLS_END}', "", TWO[:1]),  # V3.1's call
        ("9.8 is larger.", "9.8 is larger.", []),
        # the end tags cut off, the arguments closed: still a call
        (f'{CALLS_BEGIN}{CALL_BEGIN}function{SEP}add\n```json\n{{"a": 1, "b": 2}}', "", TWO[:1]),
    ],
}
# Markup that is no call, closed before anything was announced: content, as written.
NOT_CALLS = {
    MistralToolParser: ['[TOOL_CALLS]launch_rocket{"a": 1}', '[TOOL_CALLS][1, 2] and text',
                        '[TOOL_CALLS][{"name": "launch_rocket", "arguments": {}}]', "[TOOL_CALLS] Sorry, no tool fits.",
                        "[TOOL_CALLS] none fit", "Here: [TOOL_CALLS]launch_rocket{}"],
    PythonicToolParser: ["[add(1, 2)]", "[launch_rocket(x=1)]", "[add(a=x + 1)]", "[add(**kw)]"],
    Qwen3CoderToolParser: ["<tool_call>\n<function=launch_rocket>\n</function>\n</tool_call>",
                           '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'],
    DeepSeekV3ToolParser: [deepseek([("launch_rocket", {})]), f"{CALLS_BEGIN}nothing here"],
}
# Cut off inside a call (max_tokens): (output, content, calls). Markup is never content,
# except pythonic's first call, cut before it closed: the answer is text (as llama3_json's).
# Forced (required, named), nothing is ever content.
CUT = {
    MistralToolParser: [('[TOOL_CALLS]add{"a": 1', "", []), ("Let me add. [TOOL_CALLS]ad", "Let me add.", []),
                        (mistral(TWO[:1])[:-3], "", []), (mistral(TWO)[:-5], "", TWO[:1])],
    PythonicToolParser: [(pythonic(TWO)[:-3], "", TWO[:1]), ("[add(a=1), add(b=", "", [("add", {"a": 1})])],
    Qwen3CoderToolParser: [(xml(TWO[:1])[:-30], "", []), ("Adding. <tool_call>\n<function=ad", "Adding.", []),
                           (xml(TWO)[:-30], "", TWO[:1])],
    DeepSeekV3ToolParser: [(deepseek(TWO)[:-60], "", TWO[:1]), ("Hm." + deepseek(TWO)[:40], "Hm.", [])],
}


def calls_of(out: ToolOutput) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in out.calls]


def parsed(parser_cls, pieces: list[str], forced: bool = False) -> tuple[str, list]:
    out = streamed(parser_cls, pieces, TOOLS, forced)
    return out.content, calls_of(out)


@pytest.mark.parametrize("parser_cls", FORMATS)
def test_outputs_parse_whole_and_streamed_in_every_split(parser_cls):
    for text, content, calls in OUTPUTS[parser_cls]:
        whole = parse_whole(parser_cls, text, TOOLS)
        assert (whole.content, calls_of(whole)) == (content, calls), text
        assert all(c.id.startswith("call_") for c in whole.calls)
        for pieces in splits(text):
            assert parsed(parser_cls, pieces) == (content, calls), pieces


def token_pieces(tokenizer, text: str) -> list[str]:
    """`text` as a detokenizer streams it, token by token (a character split over
    byte-level tokens waits for its last byte)."""
    ids, pieces, done = tokenizer(text, add_special_tokens=False)["input_ids"], [], ""
    for k in range(1, len(ids) + 1):
        now = tokenizer.decode(ids[:k])
        if not now.endswith("\ufffd"):
            pieces.append(now[len(done):])
            done = now
    assert "".join(pieces) == text
    return pieces


@pytest.mark.parametrize("parser_cls", FORMATS)
def test_outputs_stream_token_by_token(parser_cls, tiny_tokenizer):
    for text, content, calls in OUTPUTS[parser_cls]:
        assert parsed(parser_cls, token_pieces(tiny_tokenizer, text)) == (content, calls)


@pytest.mark.parametrize("parser_cls", FORMATS)
def test_markup_that_is_no_call_is_content(parser_cls):
    for text in NOT_CALLS[parser_cls]:
        for pieces in [[text], *splits(text)]:
            assert parsed(parser_cls, pieces) == (text, []), pieces
        assert parsed(parser_cls, [text], forced=True) == ("", [])  # forced: never content, never a call


@pytest.mark.parametrize("parser_cls", FORMATS)
@pytest.mark.parametrize("forced", [False, True])
def test_a_cut_call_is_neither_content_nor_a_call(parser_cls, forced):
    for text, content, calls in CUT[parser_cls]:
        for pieces in splits(text):
            got_content, got_calls = parsed(parser_cls, pieces, forced)
            assert got_calls == calls, pieces
            assert got_content == ("" if forced else content), pieces


def test_markup_that_breaks_after_a_call_was_announced_is_neither_content_nor_a_call():
    broken = {
        Qwen3CoderToolParser: ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter> junk\n</function>\n"
                               "</tool_call>" + xml(TWO[1:])),
        DeepSeekV3ToolParser: (CALLS_BEGIN + deepseek(TWO[:1])[len(CALLS_BEGIN):-len(CALLS_END)]
                               + f"\n{CALL_BEGIN}function{SEP}get delivery date\n```json\n{{}}\n```{CALL_END}"
                               + CALLS_END),
        MistralToolParser: '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "nope"}, 7] Done.',
    }
    for parser_cls, text in broken.items():
        expected = {Qwen3CoderToolParser: ("", TWO[1:]), DeepSeekV3ToolParser: ("", TWO[:1]),
                    MistralToolParser: (", 7] Done.", TWO[:1])}[parser_cls]
        for pieces in splits(text):
            assert parsed(parser_cls, pieces) == expected, pieces


def test_a_cut_first_pythonic_call_is_text_unless_forced():
    assert parsed(PythonicToolParser, ["[add(a=1"]) == ("[add(a=1", [])
    assert parsed(PythonicToolParser, ["[add(a=1"], forced=True) == ("", [])


def deltas_of(parser, pieces: list[str]) -> list[list[tuple]]:
    return [[(d.index, d.name, d.arguments, d.done) for d in parser.push(p).calls] for p in pieces]


def test_mistral_and_deepseek_arguments_stream_as_written():
    pieces = ['[TOOL_CALLS]ad', 'd[AR', 'GS]{"a": 1', ', "b": 2', "}"]
    assert deltas_of(MistralToolParser(TOOLS), pieces) == [
        [], [], [(0, "add", '{"a": 1', False)], [(0, None, ', "b": 2', False)],
        [(0, None, "}", False), (0, None, "", True)]]
    pieces = [CALLS_BEGIN + CALL_BEGIN + "function" + SEP + "add\n```json\n", '{"a": 1', ', "b": 2}\n```', CALL_END]
    assert deltas_of(DeepSeekV3ToolParser(TOOLS), pieces) == [
        [], [(0, "add", '{"a": 1', False)], [(0, None, ', "b": 2}', False), (0, None, "", True)], []]


def test_qwen3_coder_arguments_stream_one_parameter_at_a_time():
    pieces = ["<tool_call>\n<function=add>\n", "<parameter=a>\n1", "\n</parameter>\n<parameter=b>\n2\n</par",
              "ameter>\n</function>", "\n</tool_call>"]
    assert deltas_of(Qwen3CoderToolParser(TOOLS), pieces) == [
        [(0, "add", "{", False)], [], [(0, None, '"a": 1', False)],
        [(0, None, ', "b": 2', False), (0, None, "}", True)], []]


def test_pythonic_calls_are_sent_whole_as_they_close():
    parser = PythonicToolParser(TOOLS)
    assert deltas_of(parser, ["[add(a=1", ", b=2)", ", get_delivery_date(order_id='7')", "]"]) == [
        [], [(0, "add", '{"a": 1, "b": 2}', True)], [(1, "get_delivery_date", '{"order_id": "7"}', True)], []]
    text = PythonicToolParser(TOOLS)
    assert text.push("I ").content == "I " and text.push("think").content == "think"  # text streams at once


def test_text_before_a_call_streams_before_the_call_completes():
    for parser_cls, head in [(MistralToolParser, "[TOOL_CALLS]"), (Qwen3CoderToolParser, "<tool_call>"),
                             (DeepSeekV3ToolParser, CALLS_BEGIN)]:
        parser = parser_cls(TOOLS)
        assert parser.push("Checking your order").content == "Checking your order"
        assert parser.push(" now " + head[:4]).content == " now"  # may open a call: held
        assert parser.push(head[4:]).content == ""


def test_pythonic_values():
    names = {"add", "get-time"}
    assert pythonic_call('get-time(zone="UTC", at=-1.5e3)', names) == ("get-time", '{"zone": "UTC", "at": -1500.0}')
    assert pythonic_call("add()", names) == ("add", "{}")
    for text in ["add(a=float('nan'))", "add(a={1: 2})", "add(a=b'x')", "add(a={1, 2})", "add(a=-True)", "add(a=f(1))",
                 "add(a=1)(b=2)", "nope(a=1)", "add(a=" + "[" * 5000 + "]" * 5000 + ")"]:
        assert pythonic_call(text, names) is None, text


def test_qwen3_coder_values_follow_the_schema():
    root: dict = {"$defs": {"Day": {"type": "integer"}}}
    cases = [
        ("12", {"type": "string"}, "12"), ("12", {"type": "integer"}, 12), ("1.5", {"type": "number"}, 1.5),
        ("True", {"type": "boolean"}, True), ("false", {"type": "boolean"}, False), ("None", {"type": "null"}, None),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}), ("[1, 2]", {"type": "array"}, [1, 2]),
        ("twelve", {"type": "integer"}, "twelve"),  # not JSON: kept as written (nothing checks it under auto)
        ("null", {"type": ["string", "null"]}, None), ("nil", {"type": ["string", "null"]}, "nil"),
        ("7", {"type": ["string", "integer"]}, 7), ('"7"', {"type": ["string", "integer"]}, '"7"'),
        ("3", {"$ref": "#/$defs/Day"}, 3), ("fast", {"enum": ["slow", "fast"]}, "fast"),
        ("2", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, 2),
        ("12", None, "12"), ("12", {"description": "untyped"}, "12"),  # undeclared or untyped: a string
    ]
    for text, schema, value in cases:
        assert parameter_value(text, schema, root) == value, (text, schema)


@pytest.mark.parametrize("parser_cls", FORMATS)
def test_through_the_v1_answer_with_qwen3_reasoning(parser_cls):
    """The chat completion and its stream: reasoning first, then the calls (a call written
    while thinking stays reasoning), the streamed arguments joining to the whole."""
    model = ModelConfig(id="m", tool_call_parser=parser_cls.name, reasoning_parser="qwen3")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "tools": [t.model_dump(exclude_none=True) for t in TOOLS]})
    text = "<think>Maybe " + WRITERS[parser_cls](TWO[:1]) + "?</think>\n\n" + WRITERS[parser_cls](TWO)
    body = accumulate(req, model, chunks_of(text, 3))
    choice = body["choices"][0]
    assert choice["message"]["reasoning_content"] == "Maybe " + WRITERS[parser_cls](TWO[:1]) + "?"
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == TWO
    streamed_req = ChatCompletionRequest.model_validate({**req.model_dump(exclude_none=True), "stream": True})
    deltas = [d for e in stream(streamed_req, model, chunks_of(text, 3)) if e["choices"]
              for d in e["choices"][0]["delta"].get("tool_calls") or []]
    joined = ["".join(d["function"].get("arguments", "") for d in deltas if d["index"] == i) for i in range(2)]
    assert [json.loads(a) for a in joined] == [args for _, args in TWO]


# ----------------------------------------------------------- the families' templates

HISTORY_CALLS = [("ship", {"speed": "fast", "boxes": 2, "gift": True, "tags": ["x", "y"]}),
                 ("get_delivery_date", {"order_id": "12345"})]
SHIP = Tool.model_validate({"type": "function", "function": {"name": "ship", "parameters": {
    "type": "object",
    "properties": {"speed": {"type": "string", "enum": ["slow", "fast"]},
                   "boxes": {"type": "integer", "minimum": 1, "maximum": 9},
                   "gift": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}}},
    "required": ["speed", "boxes"], "additionalProperties": False}}})
ORDER = Tool.model_validate({"type": "function", "function": {
    "name": "get_delivery_date", "strict": True,
    "parameters": {"type": "object", "properties": {"order_id": {"type": "string", "maxLength": 6},
                                                    "note": {"type": ["string", "null"], "maxLength": 4}},
                   "required": ["order_id"], "additionalProperties": False}}})
RICH_TOOLS = [ORDER, SHIP]
CONVERSATION = [
    {"role": "user", "content": "Ship order 12345 fast, and tell me when it arrives."},
    {"role": "assistant", "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        for i, (name, args) in enumerate(HISTORY_CALLS)]},
    {"role": "tool", "tool_call_id": "call_0", "content": "shipped"},
    {"role": "tool", "tool_call_id": "call_1", "content": "2024-09-10"},
]

# Small templates in each family's style: tools in the prompt, earlier calls in the format.
MISTRAL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
    "{{ c.function.arguments | tojson }}}{{ ', ' if not loop.last }}{% endfor %}]</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}"
)
# Tokenizer v11+: the name before [ARGS], one tag per call.
MISTRAL_V11_TEMPLATE = MISTRAL_TEMPLATE.replace(
    "[TOOL_CALLS][{% for c in m.tool_calls %}{\"name\": {{ c.function.name | tojson }}, \"arguments\": "
    "{{ c.function.arguments | tojson }}}{{ ', ' if not loop.last }}{% endfor %}]",
    "{% for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]{{ c.function.arguments | tojson }}{% endfor %}")
PYTHONIC_TEMPLATE = (
    "<|start_header_id|>system<|end_header_id|>\n\n{% if tools %}You can call these functions, answering with "
    "[func(param=value)]:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
    "{% if m.tool_calls %}<|python_start|>[{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}{% endfor %})"
    "{{ ', ' if not loop.last }}{% endfor %}]<|python_end|>{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
# As Qwen3-Coder's: strings raw, mappings and lists as JSON, anything else `| string` (True, 2).
QWEN3_CODER_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\n<tools>{% for t in tools %}\n<function>\n<name>{{ t.function.name }}"
    "</name>\n<parameters>{% for name, p in t.function.parameters.properties.items() %}\n<parameter>\n<name>{{ name }}"
    "</name>\n<type>{{ p.type }}</type>\n</parameter>{% endfor %}\n</parameters>\n</function>{% endfor %}\n</tools>"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n"
    "{{ v | tojson if v is mapping or (v is sequence and v is not string) else v | string }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>\n{% endfor %}"
    "{% elif m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>\n"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
DEEPSEEK_TEMPLATE = (
    "{% if tools %}## Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<｜Assistant｜><｜tool▁calls▁begin｜>"
    "{% for c in m.tool_calls %}{{ '\n' if not loop.first }}<｜tool▁call▁begin｜>{{ c.type }}<｜tool▁sep｜>"
    "{{ c.function.name }}\n```json\n{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)
# (template, parser, where the earlier calls start and end in the rendered prompt)
TEMPLATES = {
    "mistral": (MISTRAL_TEMPLATE, MistralToolParser, "[/INST]", "</s>"),
    "mistral_v11": (MISTRAL_V11_TEMPLATE, MistralToolParser, "[/INST]", "</s>"),
    "pythonic": (PYTHONIC_TEMPLATE, PythonicToolParser, "assistant<|end_header_id|>\n\n", "<|eot_id|>"),
    "qwen3_coder": (QWEN3_CODER_TEMPLATE, Qwen3CoderToolParser, "<|im_start|>assistant\n", "<|im_end|>"),
    "deepseek_v3": (DEEPSEEK_TEMPLATE, DeepSeekV3ToolParser, "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
}


def rendered(tokenizer, template: str | None, parser_name: str) -> str:
    """The conversation through the worker's prompt builder, as a model with `template` gets it."""
    if template is not None:
        tokenizer = copy.deepcopy(tokenizer)
        tokenizer.chat_template = template
    req = ChatCompletionRequest.model_validate({
        "model": "m", "messages": CONVERSATION, "tools": [t.model_dump(exclude_none=True) for t in RICH_TOOLS]})
    model = ModelConfig(id="m", tool_call_parser=parser_name)
    return PromptBuilder(tokenizer).chat_text(to_generate_request(req, "r", model))


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_calls_the_family_template_writes_read_back(tiny_tokenizer, family):
    template, parser_cls, start, end = TEMPLATES[family]
    text = rendered(tiny_tokenizer, template, parser_cls.name)
    assert "get_delivery_date" in text.split(start)[0] and "ship" in text.split(start)[0]  # the tools, shown
    earlier = text.split(start, 1)[1].split(end, 1)[0]
    for pieces in [[earlier], list(earlier)]:
        out = streamed(parser_cls, pieces, RICH_TOOLS)
        assert (out.content, calls_of(out)) == ("", HISTORY_CALLS), earlier


def test_a_template_without_tools_gets_mistral_calls_it_reads_back(tiny_tokenizer):
    """chatserve's own section (the template ignores tools) writes earlier calls in the
    list spelling, which the parser reads."""
    text = rendered(tiny_tokenizer, None, "mistral")
    assert "[AVAILABLE_TOOLS]" in text and "[TOOL_CALLS]" in text
    earlier = text.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>", 1)[0]
    assert calls_of(parse_whole(MistralToolParser, earlier, RICH_TOOLS)) == HISTORY_CALLS


# -------------------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def ll_tokenizer(tiny_tokenizer):
    return llguidance.hf.from_tokenizer(tiny_tokenizer)


def accepts(ll_tokenizer, tokenizer, grammar: str, text: str) -> bool:
    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.consume_tokens(ids) and matcher.is_accepting()


@pytest.mark.parametrize("parser_cls", FORMATS)
@pytest.mark.parametrize("choice", ["auto", "required", NAMED_ADD])
@pytest.mark.parametrize("parallel", [True, False])
def test_grammars_are_valid_llguidance(parser_cls, choice, parallel):
    for tools in (TOOLS, RICH_TOOLS + [ADD]):
        grammar = parser_cls.grammar(tools, choice, parallel)
        assert grammar is not None  # a strict function constrains auto too
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(grammar)) == ""


@pytest.mark.parametrize("parser_cls", FORMATS)
def test_auto_without_strict_functions_is_unconstrained(parser_cls):
    assert parser_cls.grammar([ADD, SHIP], "auto", True) is None


WRITTEN = [(parser_cls, write) for parser_cls, write in WRITERS.items()] + [(MistralToolParser, mistral_named)]


@pytest.mark.parametrize(("parser_cls", "write"), WRITTEN)
def test_required_allows_exactly_valid_calls(parser_cls, write, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, "required", True)
    ok = lambda calls: accepts(ll_tokenizer, tiny_tokenizer, grammar, write(calls))  # noqa: E731
    assert ok([("get_delivery_date", {"order_id": "12345"})])
    assert ok([("add", {"a": 1, "b": 2}), ("add", {"a": 3, "b": 4})])
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, "The answer is 3.")  # a call is required
    assert not ok([("get_delivery_date", {})])  # a required argument missing
    assert not ok([("get_delivery_date", {"order_id": "1", "extra": 1})])  # additionalProperties false
    assert not ok([("add", {"a": "1", "b": 2})])  # forced: non-strict functions are bound too
    assert not ok([("launch_rocket", {})])
    single = parser_cls.grammar(TOOLS, "required", False)
    assert accepts(ll_tokenizer, tiny_tokenizer, single, write([("add", {"a": 1, "b": 2})]))
    assert not accepts(ll_tokenizer, tiny_tokenizer, single, write([("add", {"a": 1, "b": 2})] * 2))


@pytest.mark.parametrize(("parser_cls", "write"), WRITTEN)
def test_named_choice_allows_only_that_function(parser_cls, write, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, NAMED_ADD, True)
    assert accepts(ll_tokenizer, tiny_tokenizer, grammar, write([("add", {"a": 1, "b": 2})]))
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, write([("get_delivery_date", {"order_id": "1"})]))
    assert not accepts(ll_tokenizer, tiny_tokenizer, grammar, write([("add", {"a": 1, "b": 2})] * 2))


@pytest.mark.parametrize(("parser_cls", "write"), WRITTEN)
def test_strict_under_auto_allows_text_or_schema_valid_calls(parser_cls, write, ll_tokenizer, tiny_tokenizer):
    grammar = parser_cls.grammar(TOOLS, "auto", True)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok("Your order ships on Monday.")
    assert ok(write([("get_delivery_date", {"order_id": "12345"})]))
    assert not ok(write([("get_delivery_date", {"oder_id": "12345"})]))  # strict: bound to its schema
    assert ok(write([("add", {"a": "x"})]))  # not strict: any arguments
    assert not ok(write([("launch_rocket", {})]))
    if parser_cls is not PythonicToolParser:  # text before the calls (pythonic answers are calls or text)
        assert ok("Let me look. " + write([("get_delivery_date", {"order_id": "9"})]))
        assert not ok("Let me look. " + write([("get_delivery_date", {"id": "9"})]))


def walk(ll_tokenizer, tokenizer, grammar: str, seed: int, steps: int = 400) -> str | None:
    """A random output the grammar allows (uniform over the allowed tokens, stopping at
    random once it may); None if it did not end within `steps` tokens."""
    rng = random.Random(seed)
    matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
    ids: list[int] = []
    for _ in range(steps):
        allowed = [i for i, b in enumerate(matcher.compute_logit_bias()) if b]
        if tokenizer.eos_token_id in allowed and (len(allowed) == 1 or rng.random() < 0.3):
            return tokenizer.decode(ids)
        ids.append(rng.choice([i for i in allowed if i != tokenizer.eos_token_id]))
        assert matcher.consume_token(ids[-1])
    return None


@pytest.mark.parametrize("parser_cls", FORMATS)
@pytest.mark.parametrize("choice", ["required", NamedToolChoice.model_validate(
    {"type": "function", "function": {"name": "ship"}})])
def test_what_the_forced_grammar_allows_the_parser_reads_as_valid_calls(parser_cls, choice, ll_tokenizer,
                                                                         tiny_tokenizer):
    """Random walks through the forced grammar (any token it allows, so tokens straddle the
    markup every way): each output is calls only, valid against their schemas."""
    for out in forced_walks(parser_cls, choice, ll_tokenizer, tiny_tokenizer):
        assert all(choice == "required" or call.name == "ship" for call in out.calls)


def forced_walks(parser_cls, choice, ll_tokenizer, tokenizer) -> list[ToolOutput]:
    """What the parser reads of 8 random walks through the forced grammar over RICH_TOOLS
    (at least 4 of them ended): calls only, each valid against its schema, the same read
    whole or a character at a time."""
    schemas = {t.function.name: t.function.parameters for t in RICH_TOOLS}
    grammar = parser_cls.grammar(RICH_TOOLS, choice, True)
    outputs = []
    for seed in range(8):
        text = walk(ll_tokenizer, tokenizer, grammar, seed)
        if text is None:
            continue
        out = parse_whole(parser_cls, text, RICH_TOOLS, forced=True)
        assert out.content == "" and out.calls, text
        for call in out.calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
        assert calls_of(streamed(parser_cls, list(text), RICH_TOOLS, forced=True)) == calls_of(out)
        outputs.append(out)
    assert len(outputs) >= 4
    return outputs


def refusal(parser_cls, tool: dict) -> str | None:
    grammar = parser_cls.grammar([Tool.model_validate(tool)], "required", False)
    return grammar_error(GuidedDecoding(kind="lark", spec=grammar, param="tools"))


def function(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def test_schemas_a_format_cannot_write_are_refused():
    whole_object = function({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                             "minProperties": 1})
    assert "minProperties" in refusal(PythonicToolParser, whole_object)
    assert "minProperties" in refusal(Qwen3CoderToolParser, whole_object)
    keyword = function({"type": "object", "properties": {"from": {"type": "string"}}, "required": ["from"]})
    assert "'from'" in refusal(PythonicToolParser, keyword)
    assert refusal(Qwen3CoderToolParser, keyword) is None
    # An optional argument that cannot be written is left out; the calls stay valid.
    assert refusal(PythonicToolParser, function({"type": "object", "properties": {"a-b": {"type": "string"}}})) is None
    pattern = function({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}})
    assert "zip" in refusal(Qwen3CoderToolParser, pattern)
    assert refusal(PythonicToolParser, pattern) is None  # JSON strings: the schema compiler handles patterns
    mixed = function({"type": "object", "properties": {"v": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}})
    assert "'v'" in refusal(Qwen3CoderToolParser, mixed)
    for parser_cls in (MistralToolParser, DeepSeekV3ToolParser):  # arguments as one JSON object: any schema
        assert refusal(parser_cls, whole_object) is None and refusal(parser_cls, mixed) is None


def test_qwen3_coder_grammar_bounds_raw_strings(ll_tokenizer, tiny_tokenizer):
    grammar = Qwen3CoderToolParser.grammar(RICH_TOOLS, "required", False)
    ok = lambda args: accepts(ll_tokenizer, tiny_tokenizer, grammar, xml([("get_delivery_date", args)],  # noqa: E731
                                                                           RICH_TOOLS))
    assert ok({"order_id": "a\nb </"}) and ok({"order_id": "", "note": "nul"})
    assert not ok({"order_id": "1234567"})  # maxLength 6, counted on the raw text
    assert not ok({"order_id": "a</parameter>b"})  # the parser would end the value there
    assert ok({"order_id": "1", "note": None})  # written "null", the only text read as null
    text = xml([("get_delivery_date", {"order_id": "1", "note": None})], RICH_TOOLS)
    assert calls_of(parse_whole(Qwen3CoderToolParser, text, RICH_TOOLS)) == [("get_delivery_date",
                                                                              {"order_id": "1", "note": None})]
    ship = lambda speed: accepts(ll_tokenizer, tiny_tokenizer, Qwen3CoderToolParser.grammar(  # noqa: E731
        RICH_TOOLS, "required", False), xml([("ship", {"speed": speed, "boxes": 2})], RICH_TOOLS))
    assert ship("fast") and not ship("faster")


def test_pythonic_grammar_keeps_the_declared_order_and_names(ll_tokenizer, tiny_tokenizer):
    names = Tool.model_validate(function({"type": "object", "properties": {
        "x": {"type": "integer"}, "y-z": {"type": "integer"}, "w": {"type": "boolean"}}, "required": ["w"]}))
    grammar = PythonicToolParser.grammar([names], "required", False)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok("[f(w=true)]") and ok("[f(x=1, w=false)]")
    assert not ok("[f(w=true, x=1)]") and not ok("[f(x=1)]") and not ok("[f()]")
    assert calls_of(parse_whole(PythonicToolParser, "[f(x=1, w=false)]", [names])) == [("f", {"x": 1, "w": False})]


@pytest.mark.parametrize(("parser", "skip"), [("mistral", False), ("deepseek_v3", False), ("hermes", True),
                                              ("qwen3_coder", True)])
def test_formats_whose_tags_are_special_tokens_decode_them_with_tools_in_play(parser, skip):
    from serve_app.dialects.chat.request import ChatCompletionRequest
    from serve_app.dialects.chat.translate import to_generate_request
    from serve_app.http.request_body import parse_request
    from workers.contract.model_config import ModelConfig

    model = ModelConfig(id="m", tool_call_parser=parser)
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    with_tools = to_generate_request(parse_request(ChatCompletionRequest, {**body, "tools": [tool]}), "id", model)
    without = to_generate_request(parse_request(ChatCompletionRequest, body), "id", model)
    assert (with_tools.params.skip_special_tokens, without.params.skip_special_tokens) == (skip, True)
