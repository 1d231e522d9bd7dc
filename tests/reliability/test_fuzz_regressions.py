"""Bugs the fuzz suite (tests/reliability/test_fuzz.py, `make fuzz`) found, each kept fixed here.

Lone UTF-16 surrogates (`"\\ud800"` in the JSON): Python's json keeps them, but they are
not Unicode text. In `model` they made the 404 response fail to encode (a bare-text
500); in a prompt they made the tokenizer raise TypeError in the worker (a 503
`worker_failed`). Now every route answers 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest

from serve_app.handle_api import _validated
from serve_app.http.errors import APIError
from serve_app.http.unicode_text import lone_surrogate_path
from tests.support.serve_fixtures import TINY_MODEL_ID, worker_stats

CHAT = '{"model": "tiny-llama", "messages": [{"role": "user", "content": %s}], "max_tokens": 2}'
LONE_SURROGATE_BODIES = [
    ("/v1/chat/completions", CHAT % '"a\\ud83d"', "messages.0.content"),
    ("/v1/chat/completions", CHAT % '[{"type": "text", "text": "\\udfff x"}]', "messages.0.content.0.text"),
    ("/v1/chat/completions", '{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', "model"),
    ("/v1/chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], '
                             '"chat_template_kwargs": {"\\ud800": 1}}', "chat_template_kwargs.\ud800"),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "\\udfff x", "echo": true, "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"model": "tiny-llama", "prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop.1"),
    ("/lm/v2/chat/completions", '{"model": "tiny-llama", "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages.0.content"),
]


@pytest.mark.parametrize("route,body,param", LONE_SURROGATE_BODIES)
def test_lone_surrogates_get_a_400_naming_the_field(tiny_app, route, body, param):
    for stream in (False, True):
        sent = body[:-1] + f', "stream": {json.dumps(stream)}}}'
        resp = httpx.post(tiny_app + route, content=sent.encode(), headers={"content-type": "application/json"},
                          timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["param"], error["code"]) == (param, "invalid_unicode"), error
    assert worker_stats("tiny", TINY_MODEL_ID).active_requests == 0


def test_escaped_surrogate_pairs_are_text_and_pass(tiny_app):
    body = CHAT % '"\\ud83d\\ude00 smile"'
    resp = httpx.post(tiny_app + "/v1/chat/completions", content=body.encode(),
                      headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_lone_surrogate_path_finds_the_shallowest_field():
    assert lone_surrogate_path({"a": ["ok", {"b": "x\ud800"}], "c": "\udfff"}) == "c"
    assert lone_surrogate_path({"a": ["ok", {"b": "x\ud800"}]}) == "a.1.b"
    assert lone_surrogate_path({"k": {"\udc00": 1}}) == "k.\udc00"
    assert lone_surrogate_path({"a": "\U0001F600 é 中", "b": [1, None, 2.5]}) is None
    deep: list = []
    for _ in range(100_000):  # iterative: no recursion limit
        deep = [deep]
    assert lone_surrogate_path({"deep": deep}) is None


def test_error_responses_encode_any_text():
    resp = APIError(404, "The model `\ud800` does not exist").response()
    assert json.loads(resp.body)["error"]["message"] == "The model `\ud800` does not exist"


def test_handle_api_refuses_lone_surrogates():
    with pytest.raises(APIError) as info:
        _validated({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "a\ud83d"}]})
    assert (info.value.status, info.value.param) == (400, "messages.0.content")
