"""gpt-oss's harmony output (serve_app/output/harmony.py): the analysis channel as reasoning,
the final channel as the answer, messages to `functions.NAME` as calls, whole and streamed
in every split, through both parsers and the tool parser alone; reasoning tokens counted;
the ingress decoding with special tokens; the forced and strict grammars checked with
llguidance; and calls a harmony-style chat template writes read back."""

from __future__ import annotations

import json

import pytest

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.output.call_deltas import merged
from serve_app.output.choice_parser import OutputParsing
from serve_app.output.harmony import GptOssReasoningParser, HarmonyToolParser
from serve_app.schema.tools import NamedToolChoice
from tests.support.tool_calls import parse_whole, splits, streamed
from tests.unit.api.test_chat_output import accumulate, chunks_of, stream
from tests.unit.api.test_tool_formats import (
    CONVERSATION,
    HISTORY_CALLS,
    NAMED_ADD,
    RICH_TOOLS,
    TOOLS,
    TWO,
    accepts,
    calls_of,
    forced_walks,
    ll_tokenizer,  # noqa: F401 (a fixture)
    rendered,
)
from workers.contract.model_config import ModelConfig


def call(name: str, args: dict, recipient_in_role: bool = False) -> str:
    if recipient_in_role:
        return f"<|start|>assistant to=functions.{name}<|channel|>commentary json<|message|>{json.dumps(args)}<|call|>"
    return f"<|start|>assistant<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>" \
           f"{json.dumps(args)}<|call|>"


def analysis(text: str) -> str:
    return f"<|channel|>analysis<|message|>{text}<|end|>"


FINAL = "<|start|>assistant<|channel|>final<|message|>"
ADD_CALL, ORDER_CALL = TWO

# (model output, reasoning, content, calls) through both parsers
OUTPUTS = [
    (analysis("Easy.") + FINAL + "Hello!<|return|>", "Easy.", "Hello!", []),
    (analysis("Easy.") + FINAL + "Hello!", "Easy.", "Hello!", []),  # the stop token left out of the text
    (analysis("Add them.") + call(*ADD_CALL), "Add them.", "", [ADD_CALL]),
    (analysis("Look up.") + call(*ORDER_CALL, recipient_in_role=True)[:-len("<|call|>")], "Look up.", "", [ORDER_CALL]),
    # a preamble (commentary, no recipient) is content
    ("<|channel|>commentary<|message|>Let me add.<|end|>" + call(*ADD_CALL), "", "Let me add.", [ADD_CALL]),
    ("Plain text, no harmony at all.", "", "Plain text, no harmony at all.", []),
    # a call to an undeclared function: its body is content
    ("<|channel|>commentary to=functions.launch_rocket<|message|>{}<|call|>", "", "{}", []),
    # a body that is no arguments object, and a call cut off: neither content nor a call
    ("<|channel|>commentary to=functions.add<|message|>oops<|call|>", "", "", []),
    (analysis("Add.") + call(*ADD_CALL)[:-12], "Add.", "", []),
    ("<|channel|>analysis<|message|>Still thinking when cut", "Still thinking when cut", "", []),
    # braces inside strings do not end the arguments
    (call("get_delivery_date", {"order_id": "}{"}), "", "", [("get_delivery_date", {"order_id": "}{"})]),
    # a "header" that never reaches <|message|> is text, its tag included
    ("<|start|>" + "x" * 300 + " done", "", "<|start|>" + "x" * 300 + " done", []),
]


def both(pieces: list[str], tools=TOOLS) -> tuple[str, str, list]:
    parser = OutputParsing(tools=tuple(tools), tool_parser=HarmonyToolParser,
                           reasoning_parser=GptOssReasoningParser).new_choice(False)
    reasoning, content, deltas = "", "", []
    for piece in pieces:
        out = parser.push(piece, 1)
        reasoning, content, deltas = reasoning + out.reasoning, content + out.content, deltas + out.calls
    out = parser.finish()
    reasoning, content, deltas = reasoning + out.reasoning, content + out.content, deltas + out.calls
    return reasoning, content, [(c.name, json.loads(c.arguments)) for c in merged(deltas)]


@pytest.mark.parametrize("case", OUTPUTS, ids=range(len(OUTPUTS)))
def test_outputs_split_into_reasoning_content_and_calls_in_every_split(case):
    text, reasoning, content, calls = case
    for pieces in [[text], *splits(text)]:
        assert both(pieces) == (reasoning, content, calls), pieces


@pytest.mark.parametrize("case", OUTPUTS, ids=range(len(OUTPUTS)))
def test_the_tool_parser_alone_gives_the_analysis_as_content(case):
    text, reasoning, content, calls = case
    for pieces in [[text], *splits(text)]:
        out = streamed(HarmonyToolParser, pieces, TOOLS)  # checks the deltas' OpenAI shape too
        assert (out.content, calls_of(out)) == (reasoning + content, calls), pieces


def test_forced_calls_are_never_content():
    out = parse_whole(HarmonyToolParser, analysis("Hm.") + call(*ADD_CALL), TOOLS, forced=True)
    assert (out.content, calls_of(out)) == ("", [ADD_CALL])


def test_arguments_stream_as_written():
    parser = HarmonyToolParser(TOOLS)
    first = parser.push('<|channel|>commentary to=functions.add<|message|>{"a": ')
    assert [(c.name, c.arguments) for c in first.calls] == [("add", '{"a": ')]
    rest = parser.push('1, "b": 2}<|call|>')
    assert "".join(c.arguments for c in rest.calls) == '1, "b": 2}' and rest.calls[-1].done


def test_reasoning_tokens_are_the_analysis_messages_tokens():
    tokens = ["<|channel|>", "analysis", "<|message|>", "A", "B", "<|end|>", "<|start|>", "assistant", "<|channel|>",
              "final", "<|message|>", "Hi", "<|return|>"]
    parser = GptOssReasoningParser()
    for token in tokens:
        parser.push(token, 1)
    parser.finish()
    assert parser.reasoning_tokens == 6


def test_an_output_the_prompt_opened_in_analysis_starts_as_reasoning():
    parser = GptOssReasoningParser(reasoning_open=True)
    out = parser.push("Thinking.<|end|>" + FINAL + "Done.")
    last = parser.finish()
    assert (out.reasoning + last.reasoning, out.content + last.content) == ("Thinking.", "Done.")


def test_the_ingress_decodes_harmony_with_special_tokens():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    reasoning_only = ModelConfig(id="m", reasoning_parser="openai_gptoss")
    assert to_generate_request(req, "r", reasoning_only).params.skip_special_tokens is False
    assert to_generate_request(req, "r", ModelConfig(id="m", reasoning_parser="qwen3")).params.skip_special_tokens
    with_tools = ChatCompletionRequest.model_validate({**req.model_dump(exclude_none=True),
                                                       "tools": [t.model_dump(exclude_none=True) for t in TOOLS]})
    tools_only = ModelConfig(id="m", tool_call_parser="openai")
    assert to_generate_request(with_tools, "r", tools_only).params.skip_special_tokens is False


def test_through_the_v1_answer_and_its_stream():
    model = ModelConfig(id="m", tool_call_parser="openai", reasoning_parser="openai_gptoss")
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "tools": [t.model_dump(exclude_none=True) for t in TOOLS]})
    text = analysis("Add 1 and 2.") + call(*ADD_CALL)
    choice = accumulate(req, model, chunks_of(text, 3))["choices"][0]
    assert choice["message"]["reasoning_content"] == "Add 1 and 2."
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in choice["message"]["tool_calls"]] == [ADD_CALL]
    streamed_req = ChatCompletionRequest.model_validate({**req.model_dump(exclude_none=True), "stream": True})
    deltas = [e["choices"][0]["delta"] for e in stream(streamed_req, model, chunks_of(text, 3)) if e["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Add 1 and 2."
    arguments = "".join(c["function"].get("arguments", "") for d in deltas for c in d.get("tool_calls") or [])
    assert json.loads(arguments) == ADD_CALL[1]


# -------------------------------------------------------------------------- grammars


def written(calls: list[tuple[str, dict]]) -> str:
    """A forced output: the call's header in the grammar's spelling (the prompt ends at the role)."""
    name, args = calls[0]
    return f"<|channel|>commentary to=functions.{name}<|message|>{json.dumps(args)}"


def test_required_allows_exactly_one_valid_call(ll_tokenizer, tiny_tokenizer):  # noqa: F811
    grammar = HarmonyToolParser.grammar(TOOLS, "required", True)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok(written([("get_delivery_date", {"order_id": "12345"})]))
    assert not ok("The answer is 3.")
    assert not ok(written([("get_delivery_date", {})]))
    assert not ok(written([("add", {"a": "1", "b": 2})]))  # forced: bound to the schema
    assert not ok(written([("launch_rocket", {})]))
    named = HarmonyToolParser.grammar(TOOLS, NAMED_ADD, True)
    assert accepts(ll_tokenizer, tiny_tokenizer, named, written([ADD_CALL]))
    assert not accepts(ll_tokenizer, tiny_tokenizer, named, written([("get_delivery_date", {"order_id": "1"})]))


def test_strict_under_auto_allows_reasoning_and_text_or_valid_calls(ll_tokenizer, tiny_tokenizer):  # noqa: F811
    grammar = HarmonyToolParser.grammar(TOOLS, "auto", True)
    ok = lambda text: accepts(ll_tokenizer, tiny_tokenizer, grammar, text)  # noqa: E731
    assert ok(analysis("Easy.") + FINAL + "Monday.")
    assert ok(analysis("Look up.") + "<|start|>assistant" + written([("get_delivery_date", {"order_id": "9"})]))
    assert not ok(analysis("Look up.") + "<|start|>assistant" + written([("get_delivery_date", {"id": "9"})]))
    assert HarmonyToolParser.grammar(TOOLS[1:], "auto", True) is None  # no strict function: free


@pytest.mark.parametrize("choice", ["required", NamedToolChoice.model_validate(
    {"type": "function", "function": {"name": "ship"}})])
def test_what_the_forced_grammar_allows_the_parser_reads_as_a_valid_call(choice, ll_tokenizer,  # noqa: F811
                                                                          tiny_tokenizer):
    for out in forced_walks(HarmonyToolParser, choice, ll_tokenizer, tiny_tokenizer):
        assert len(out.calls) == 1  # one call a turn
        assert choice == "required" or out.calls[0].name == "ship"


# --------------------------------------------------------------- the family's template

# In gpt-oss's style: tools in a developer message, each earlier call its own message
# addressed to the function, each result a message from it.
HARMONY_TEMPLATE = (
    "{% if tools %}<|start|>developer<|message|># Tools\nnamespace functions {\n{% for t in tools %}"
    "{{ t | tojson }}\n{% endfor %}}<|end|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}<|start|>assistant"
    "<|channel|>commentary to=functions.{{ c.function.name }} <|constrain|>json<|message|>"
    "{{ c.function.arguments | tojson }}<|call|>{% endfor %}"
    "{% elif m.role == 'tool' %}<|start|>functions.x to=assistant<|channel|>commentary<|message|>"
    "{{ m.content | tojson }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_calls_the_family_template_writes_read_back(tiny_tokenizer):
    text = rendered(tiny_tokenizer, HARMONY_TEMPLATE, "openai")
    tools_part, turns = text.split("<|start|>user", 1)
    assert "get_delivery_date" in tools_part and "ship" in tools_part
    earlier = turns.split("<|end|>", 1)[1].split("<|start|>functions", 1)[0]
    assert CONVERSATION[1]["tool_calls"] and earlier.count("<|call|>") == len(HISTORY_CALLS)
    for pieces in [[earlier], list(earlier)]:
        out = streamed(HarmonyToolParser, pieces, RICH_TOOLS)
        assert (out.content, calls_of(out)) == ("", HISTORY_CALLS), earlier
