"""vLLM's structural tags as `response_format` and as `structured_outputs.structural_tag`:
the grammar they become lets free text through and holds each tagged segment to its
schema (checked token by token with llguidance on the tiny tokenizer), and bad tags are a
400 naming the field."""

from __future__ import annotations

import json

import llguidance.hf
import pytest
from llguidance import LLMatcher

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.http.errors import APIError
from serve_app.http.request_body import parse_request

ADD = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
TAG = {"type": "structural_tag", "triggers": ["<f="],
       "structures": [{"begin": "<f=add>", "schema": ADD, "end": "</f>"},
                      {"begin": "<f=echo>", "schema": {"type": "string"}, "end": "</f>"}]}


def guided(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return to_generate_request(parse_request(ChatCompletionRequest, body), "id").params.guided


@pytest.fixture(scope="module")
def accepts(tiny_tokenizer):
    ll_tokenizer = llguidance.hf.from_tokenizer(tiny_tokenizer)

    def check(grammar: str, text: str) -> bool:
        matcher = LLMatcher(ll_tokenizer, LLMatcher.grammar_from_lark(grammar), log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.consume_tokens(ids) and matcher.is_accepting()

    return check


def test_both_fields_give_the_same_grammar():
    by_format = guided(response_format=TAG)
    by_field = guided(structured_outputs={"structural_tag": json.dumps(TAG)})
    assert by_format.kind == by_field.kind == "lark" and by_format.spec == by_field.spec
    assert (by_format.param, by_field.param) == ("response_format", "structured_outputs.structural_tag")


@pytest.mark.parametrize(("text", "ok"), [
    ("just text, no call", True),
    ('Adding: <f=add>{"a": 1}</f> and <f=echo>"hi"</f> done', True),
    ('<f=add>{"a": "one"}</f>', False),  # the schema wants an integer
    ('<f=add>{"a": 1, "b": 2}</f>', False),  # no other keys
    ("<f=sub>{}</f>", False),  # a trigger opens only the listed structures
])
def test_free_text_with_segments_held_to_their_schema(accepts, text, ok):
    assert accepts(guided(response_format=TAG).spec, text) is ok


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": {**TAG, "triggers": ["<g="]}}, "response_format", "starts with none of the triggers"),
    ({"response_format": {**TAG, "structures": []}}, "response_format", "structures"),
    ({"structured_outputs": {"structural_tag": "{not json"}}, "structured_outputs.structural_tag", "not a structural"),
    ({"structured_outputs": {"structural_tag": {**TAG, "structures": [{"begin": "<f=x>", "schema": {"type": 5}}]}}},
     "structured_outputs.structural_tag", "not a valid JSON schema"),
    ({"structured_outputs": {"structural_tag": TAG, "regex": "a"}}, "structured_outputs.structural_tag", "one"),
])
def test_bad_tags_are_400_naming_the_field(fields, param, words):
    with pytest.raises(APIError) as info:
        guided(**fields)
    assert (info.value.status, info.value.param) == (400, param), info.value.message
    assert words in info.value.message
