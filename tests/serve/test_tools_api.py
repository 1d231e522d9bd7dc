"""Tool calling and reasoning output over HTTP, on tiny random models served by Ray Serve,
and the request rules (400 naming the field) checked without a server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from serve_app.dialects.chat.request import ChatCompletionRequest
from serve_app.dialects.chat.translate import to_generate_request
from serve_app.http.errors import APIError
from serve_app.ingress import parse_request
from tests.support.tools_app import THINKER, TOOLS_MODEL

SHIP = {"type": "function", "function": {
    "name": "ship", "description": "Ship an order.",
    "parameters": {"type": "object",
                   "properties": {"speed": {"enum": ["slow", "fast"]}, "boxes": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["speed", "boxes"], "additionalProperties": False}}}
NAMED_SHIP = {"type": "function", "function": {"name": "ship"}}
USER = [{"role": "user", "content": "Ship my order fast."}]


# ------------------------------------------------------------------------ request rules

def rejected(body: dict) -> APIError:
    body = {"model": "m", "messages": USER, **body}
    with pytest.raises(APIError) as info:
        to_generate_request(parse_request(ChatCompletionRequest, body), "r")
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": [{"type": "retrieval", "function": SHIP["function"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {**SHIP["function"], "name": "ship it!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a" * 65}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {**SHIP["function"], "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"x": {"minimum": "0"}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [SHIP, SHIP]}, "tools"),
    # valid JSON schema, but a look-ahead pattern llguidance cannot enforce (only checked when forced or strict)
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(?=a)b"}}}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": NAMED_SHIP}, "tool_choice"),
    ({"tools": [SHIP], "tool_choice": {"type": "function", "function": {"name": "fly"}}}, "tool_choice"),
    ({"tools": [SHIP], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [SHIP], "tool_choice": "required", "n": 2, "use_beam_search": True, "temperature": 0}, "tool_choice"),
    ({"tools": [SHIP], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER + [{"role": "tool", "content": "done"}]}, "messages.1"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "ship", "arguments": "{}"}}]}]}, "messages.0"),
])
def test_bad_tool_requests_are_400_naming_the_field(body, param):
    assert rejected(body).param == param


def test_tool_fields_accepted_and_translated():
    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": USER, "tools": [SHIP]})
    request = to_generate_request(req, "r")
    assert request.tools == [SHIP] and request.params.guided is None  # auto, no strict function: free
    forced = to_generate_request(parse_request(ChatCompletionRequest, {
        "model": "m", "messages": USER, "tools": [SHIP], "tool_choice": NAMED_SHIP}), "r")
    assert forced.params.guided.kind == "lark" and '"const": "ship"' in forced.params.guided.spec
    none = to_generate_request(parse_request(ChatCompletionRequest, {
        "model": "m", "messages": USER, "tools": [SHIP], "tool_choice": "none"}), "r")
    assert none.tools is None and none.params.guided is None


# ------------------------------------------- over HTTP (tools_app: tests/support/tools_app.py)

def test_forced_call_has_the_documented_shape(tools_app):
    body = {"model": TOOLS_MODEL, "messages": USER, "tools": [SHIP], "tool_choice": NAMED_SHIP,
            "max_tokens": 128, "seed": 3}
    resp = httpx.post(tools_app + "/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"] == "ship"
    jsonschema.validate(json.loads(call["function"]["arguments"]), SHIP["function"]["parameters"])


def test_openai_client_reads_calls_plain_and_streamed(tools_app):
    client = openai.OpenAI(base_url=tools_app + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=TOOLS_MODEL, messages=USER, tools=[SHIP], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=128, seed=5)
    out = client.chat.completions.create(**kwargs)
    [call] = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == "ship"
    # The SDK's own stream assembly (ChatCompletionStreamState) rebuilds the same message.
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    [streamed] = final.choices[0].message.tool_calls
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert streamed.id.startswith("call_")
    # Assembling by hand: the first delta of a call names it, later ones append arguments.
    arguments, names = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for delta_call in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta_call.index == 0
            names += [delta_call.function.name] if delta_call.function.name else []
            arguments += delta_call.function.arguments or ""
    assert names == ["ship"] and json.loads(arguments) == json.loads(call.function.arguments)


def test_reasoning_is_split_on_v1_and_kept_on_lm_v2(tools_app):
    """The thinker's template opens <think>, so its (random) output is all reasoning on /v1;
    /lm/v2 returns the same greedy text untouched in content."""
    v1 = httpx.post(tools_app + "/v1/chat/completions", timeout=120, json={
        "model": THINKER, "messages": USER, "temperature": 0, "max_tokens": 12}).json()
    lm = httpx.post(tools_app + "/lm/v2/chat/completions", timeout=120, json={
        "model": THINKER, "messages": USER, "top_p": 0, "max_completion_tokens": 12}).json()
    raw = lm["choices"][0]["message"]["content"]
    message = v1["choices"][0]["message"]
    assert raw and message["reasoning_content"] == raw and message["content"] == ""
    assert v1["usage"]["completion_tokens_details"] == {"reasoning_tokens": v1["usage"]["completion_tokens"]}

    off = httpx.post(tools_app + "/v1/chat/completions", timeout=120, json={
        "model": THINKER, "messages": USER, "temperature": 0, "max_tokens": 12,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["choices"][0]["message"].get("reasoning_content") is None
    assert off["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


def test_reasoning_streams_as_reasoning_content(tools_app):
    client = openai.OpenAI(base_url=tools_app + "/v1", api_key="unused", max_retries=0)
    kwargs = dict(model=THINKER, messages=USER, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs)
    pieces = [c.choices[0].delta for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in pieces)
    assert reasoning == whole.choices[0].message.reasoning_content
    assert "".join(d.content or "" for d in pieces) == whole.choices[0].message.content


def test_a_thinking_budget_closes_the_reasoning_through_serve(tools_app):
    """thinking_token_budget through the whole path (ingress translation, the worker's tag
    ids, the engine's forced end tag, the reasoning parser): the greedy reasoning stops
    after the budget, where the unbudgeted answer goes on thinking, and the rest is content."""
    body = {"model": THINKER, "messages": USER, "temperature": 0, "max_tokens": 16, "ignore_eos": True}
    free = httpx.post(tools_app + "/v1/chat/completions", timeout=120, json=body).json()
    capped = httpx.post(tools_app + "/v1/chat/completions", timeout=120,
                        json={**body, "thinking_token_budget": 3}).json()
    free_message, capped_message = free["choices"][0]["message"], capped["choices"][0]["message"]
    assert free_message["content"] == "" and free["usage"]["completion_tokens_details"]["reasoning_tokens"] == 16
    assert capped_message["reasoning_content"] and capped_message["content"]
    assert free_message["reasoning_content"].startswith(capped_message["reasoning_content"].rstrip())
    assert 3 <= capped["usage"]["completion_tokens_details"]["reasoning_tokens"] < 16
    assert capped["usage"]["completion_tokens"] == 16
