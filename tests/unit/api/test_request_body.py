"""Reading bodies and JSON text safely: strict JSON, a nesting bound, and deeply nested
tool-call text (from a client or a model) treated as malformed, never as a crash."""

from __future__ import annotations

import json

import pytest

from serve_app.http.errors import APIError
from serve_app.http.request_body import MAX_JSON_DEPTH, json_depth, parse_json_object
from serve_app.output.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolOutput,
)
from tests.support.tool_calls import parse_whole
from tests.unit.api.test_tool_parsers import TOOLS
from workers.contract.json_text import loads_json_text
from workers.text.prompts import ToolPrompt, tools_as_text


def lists(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize(("value", "depth"), [
    ({}, 1), ({"a": 1}, 1), ({"a": [1, {"b": []}]}, 4), (json.loads(lists(10)), 10), (7, 0), ("x", 0),
])
def test_json_depth(value, depth):
    assert json_depth(value) == depth


def test_the_depth_limit_is_inclusive():
    at_limit = '{"a": ' + lists(MAX_JSON_DEPTH - 1) + "}"
    assert json_depth(parse_json_object(at_limit.encode())) == MAX_JSON_DEPTH
    with pytest.raises(APIError, match="nested too deeply") as err:
        parse_json_object(('{"a": ' + lists(MAX_JSON_DEPTH) + "}").encode())
    assert err.value.status == 400 and err.value.code == "invalid_json"


@pytest.mark.parametrize("body", [b'{"a": NaN}', b'{"a": Infinity}', b'{"a": [-Infinity]}'])
def test_non_finite_literals_are_not_json(body):
    with pytest.raises(APIError, match="is not a JSON number"):
        parse_json_object(body)


@pytest.mark.parametrize("body", [b"\xff\xfe{}", b'{"a": "\xc3("}', b"", b"{", b"[" * 200_000])
def test_broken_bodies_are_400(body):
    with pytest.raises(APIError) as err:
        parse_json_object(body)
    assert err.value.status == 400 and err.value.code == "invalid_json"


def test_json_text_nested_past_the_recursion_limit_is_a_value_error():
    with pytest.raises(ValueError, match="nested too deeply"):
        loads_json_text(lists(100_000))
    assert loads_json_text(lists(3)) == [[[]]]


@pytest.mark.parametrize("text", [
    "<tool_call>" + '{"name": "add", "arguments": ' + lists(100_000) + "}</tool_call>",
    "<tool_call>" + '{"name": "add", "arguments": "' + lists(100_000) + '"}</tool_call>',
])
def test_model_output_nested_too_deeply_comes_back_as_content(text):
    assert parse_whole(HermesToolParser, text, TOOLS) == ToolOutput(text, [])


def test_llama3_output_nested_too_deeply_comes_back_as_content():
    text = '{"name": "add", "parameters": ' + lists(100_000) + "}"
    assert parse_whole(Llama3JsonToolParser, text, TOOLS) == ToolOutput(text, [])


def test_a_client_tool_call_with_deeply_nested_arguments_is_rendered_as_text():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": lists(100_000)}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    fmt = ToolPrompt(system_section="tools", call_open="<c>", call_close="</c>", result_open="<r>",
                     result_close="</r>", arguments_key="arguments")
    rendered = tools_as_text(messages, [], fmt)
    assert lists(100_000) in rendered[1]["content"]
