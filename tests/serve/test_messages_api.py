"""/v1/messages and /v1/messages/count_tokens over HTTP with the official `anthropic` Python
SDK: on the tiny app (create, stream, stop sequences, prefill, JSON output, token counts,
images refused by a text-only model, errors in Anthropic's shape), and on a tiny model with
room for tools (a two-turn tool loop, streamed and not)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
)
from tests.support.tools_app import TOOLS_MODEL

SHIP = {"name": "ship", "description": "Ship an order.",
        "input_schema": {"type": "object", "properties": {"speed": {"enum": ["slow", "fast"]}},
                         "required": ["speed"], "additionalProperties": False}}
CHOICE = {"type": "object", "properties": {"role": {"enum": ["admin", "user"]},
                                           "level": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["role", "level"], "additionalProperties": False}
# A 1x1 PNG.
PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==")


def client_for(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)


def greedy(**kwargs) -> dict:
    # The SDK of this version no longer takes temperature as an argument; the API does.
    return {"extra_body": {"temperature": 0, **kwargs.pop("extra_body", {})}, **kwargs}


# ------------------------------------------------------------------------ the tiny app

def test_create_with_system_and_usage(tiny_app):
    out = client_for(tiny_app).messages.create(**greedy(
        model=TINY_MODEL_ID, max_tokens=6, system="Be brief.", metadata={"user_id": "u-1"},
        messages=[{"role": "user", "content": "Say hi."}]))
    assert out.id.startswith("msg_") and out.type == "message" and out.role == "assistant"
    assert out.model == TINY_MODEL_ID and out.stop_reason == "max_tokens" and out.stop_sequence is None
    [block] = out.content
    assert block.type == "text" and block.text
    assert out.usage.output_tokens == 6 and out.usage.input_tokens > 0


def test_stream_events_in_order_and_equal_to_the_whole_message(tiny_app):
    client = client_for(tiny_app)
    kwargs = greedy(model=TINY_MODEL_ID, max_tokens=12, messages=[{"role": "user", "content": "Tell a story."}])
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    names = [e.type for e in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-2:] == ["message_delta", "message_stop"]
    assert names[-3] == "content_block_stop" and "content_block_delta" in names
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert deltas == final.content[0].text == whole.content[0].text
    assert events[0].message.usage.input_tokens == whole.usage.input_tokens
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)


def test_stop_sequence_ends_the_answer_and_is_named(tiny_app):
    client = client_for(tiny_app)
    kwargs = greedy(model=TINY_MODEL_ID, max_tokens=24, messages=[{"role": "user", "content": "Count."}])
    text = client.messages.create(**kwargs).content[0].text
    stop = text[4:6]
    assert len(stop) == 2, text
    out = client.messages.create(stop_sequences=[stop], **kwargs)
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", stop)
    assert out.content[0].text == text[:text.index(stop)]


def test_an_assistant_turn_last_is_continued_and_counted(tiny_app):
    client = client_for(tiny_app)
    messages = [{"role": "user", "content": "Pick a role."}, {"role": "assistant", "content": "The role is"}]
    out = client.messages.create(**greedy(model=TINY_MODEL_ID, max_tokens=4, messages=messages))
    counted = client.messages.count_tokens(model=TINY_MODEL_ID, messages=messages)
    assert counted.input_tokens == out.usage.input_tokens
    opened = client.messages.count_tokens(model=TINY_MODEL_ID, messages=messages[:1])
    assert counted.input_tokens > opened.input_tokens


def test_count_tokens_equals_the_prompt_of_a_create(tiny_app):
    client = client_for(tiny_app)
    kwargs = dict(model=TINY_MODEL_ID, system="Be brief.", messages=[{"role": "user", "content": "Say hi."}])
    counted = client.messages.count_tokens(**kwargs)
    assert counted.input_tokens == client.messages.create(max_tokens=1, **kwargs).usage.input_tokens


def test_json_schema_output_format_constrains_the_answer(tiny_app):
    out = client_for(tiny_app).messages.create(
        model=TINY_MODEL_ID, max_tokens=64, messages=[{"role": "user", "content": "Pick a role."}],
        output_config={"format": {"type": "json_schema", "schema": CHOICE}}, extra_body={"seed": 3})
    assert out.stop_reason == "end_turn", out.content
    jsonschema.validate(json.loads(out.content[0].text), CHOICE)


def test_vllm_structured_outputs_field_on_messages(tiny_app):
    out = client_for(tiny_app).messages.create(
        model=TINY_MODEL_ID, max_tokens=16, messages=[{"role": "user", "content": "Yes or no?"}],
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}, "temperature": 1.0, "seed": 1})
    assert out.content[0].text in ("yes", "no") and out.stop_reason == "end_turn"


def test_images_are_refused_by_a_text_only_model(tiny_app):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    with pytest.raises(anthropic.BadRequestError) as info:
        client_for(tiny_app).messages.create(model=TINY_MODEL_ID, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}])
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "text-only" in info.value.body["error"]["message"]


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"model": "no-such-model"}, 404, "not_found_error", "does not exist"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 100_000}, 400, "invalid_request_error", "maximum context length"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
     "tools.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, 400,
     "invalid_request_error", "messages.0.content.0.type"),
    ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, 400, "invalid_request_error",
     "thinking.budget_tokens"),
])
def test_errors_have_anthropics_shape(tiny_app, body, status, kind, words):
    request = {"model": TINY_MODEL_ID, "max_tokens": 8, "messages": [{"role": "user", "content": "x"}], **body}
    resp = httpx.post(tiny_app + "/v1/messages", json={k: v for k, v in request.items() if v is not None},
                      timeout=60)
    payload = resp.json()
    assert (resp.status_code, payload["type"], payload["error"]["type"]) == (status, "error", kind), payload
    assert words in payload["error"]["message"]


def test_count_tokens_errors_have_anthropics_shape(tiny_app):
    resp = httpx.post(tiny_app + "/v1/messages/count_tokens", json={"model": "nope", "messages": []}, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------- with tools

def test_a_two_turn_tool_loop(tools_app):
    client = client_for(tools_app)
    ask = {"role": "user", "content": "Ship my order fast."}
    kwargs = greedy(model=TOOLS_MODEL, tools=[SHIP], max_tokens=128)
    forced = {"type": "tool", "name": "ship", "disable_parallel_tool_use": True}
    turn = client.messages.create(messages=[ask], tool_choice=forced, **kwargs)
    [call] = [block for block in turn.content if block.type == "tool_use"]
    assert turn.stop_reason == "tool_use" and call.name == "ship" and call.id
    jsonschema.validate(call.input, SHIP["input_schema"])

    with client.messages.stream(messages=[ask], tool_choice=forced, **kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    json_deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta"]
    assert json_deltas and json.loads("".join(json_deltas)) == call.input
    assert [(b.type, b.name, b.input) for b in streamed.content] == [("tool_use", "ship", call.input)]
    assert streamed.stop_reason == "tool_use"

    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "shipped"}]}
    history = [ask, {"role": "assistant", "content": turn.content}, result]
    answer_kwargs = {**kwargs, "max_tokens": 8, "tool_choice": {"type": "none"}}
    answer = client.messages.create(messages=history, **answer_kwargs)
    assert [b.type for b in answer.content] == ["text"] and answer.stop_reason == "max_tokens"
    # The call and its result are in the prompt, and counted the same way.
    assert answer.usage.input_tokens > client.messages.create(messages=[ask], **answer_kwargs).usage.input_tokens
    counted = client.messages.count_tokens(model=TOOLS_MODEL, messages=history, tools=[SHIP],
                                           tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens
