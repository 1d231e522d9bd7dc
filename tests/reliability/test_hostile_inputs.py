"""Hostile inputs through the real Serve HTTP path, each with its expected status and message.

The table covers the issue's list: broken bytes and JSON, bodies over the size limit, deep
nesting, huge message lists, prompts past the context window, NaN/Infinity and
out-of-range numbers, wrong types, thousands of stop strings, invalid and recursive tool
schemas. (Image paths, file:// and private URLs, and decompression bombs are in
tests/serve/test_vision_serve.py, on a vision model; API keys in tests/serve/test_auth.py; a tool
schema that admits nothing, which needs a longer context than this app's, in
tests/unit/sampling/test_guided.py.)

After the table the worker must be the same process, with nothing left running, and a
stream that ran through all of it must be exactly what it is alone.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.support.serve_fixtures import TINY_MODEL_ID, worker_stats

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello"}]
BASE = {"model": TINY_MODEL_ID, "messages": USER, "max_tokens": 4}
LIMIT = 4 * 1024 * 1024  # server.max_request_bytes, the default


def nested(depth: int) -> bytes:
    return b'{"model": "%s", "messages": %s%s}' % (TINY_MODEL_ID.encode(), b"[" * depth, b"]" * depth)


def recursive_schema() -> dict:
    node = {"type": "object", "properties": {"value": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}},
            "required": ["value"]}
    return {"$defs": {"node": node}, "$ref": "#/$defs/node"}


def tool(parameters: dict) -> dict:
    return {"type": "function", "function": {"name": "walk", "parameters": parameters}}


# (id, route, body: dict | bytes, status, error code or None, words the message must contain, param)
CASES = [
    ("utf8-invalid", CHAT, b'{"model": "\xff\xfe", "messages": []}', 400, "invalid_json", "JSON", None),
    ("utf8-invalid-in-string", CHAT, b'{"model": "x", "messages": [{"role": "user", "content": "a\xc3("}]}',
     400, "invalid_json", "JSON", None),
    ("lone-utf16-surrogate", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}'
     % TINY_MODEL_ID.encode(),
     400, "invalid_unicode", "surrogate", "messages.0.content"),
    ("json-broken", CHAT, b'{"model": ', 400, "invalid_json", "JSON", None),
    ("json-empty", CHAT, b"", 400, "invalid_json", "JSON", None),
    ("json-not-object", CHAT, b"[1, 2]", 400, "invalid_json", "object", None),
    ("json-nan-literal", CHAT, b'{"model": "%s", "messages": [], "temperature": NaN}' % TINY_MODEL_ID.encode(),
     400, "invalid_json", "NaN", None),
    ("json-infinity-literal", CHAT, json.dumps({**BASE, "max_tokens": 1}).replace("1}", "-Infinity}").encode(),
     400, "invalid_json", "Infinity", None),
    ("nested-past-parser", CHAT, nested(100_000), 400, "invalid_json", "nested", None),
    ("nested-deep", CHAT, nested(500), 400, "invalid_json", "nested", None),
    ("nested-in-template-kwargs", CHAT,
     {**BASE, "chat_template_kwargs": json.loads('{"a": ' * 200 + "1" + "}" * 200)},
     400, "invalid_json", "nested", None),
    ("huge-message-list", CHAT, {**BASE, "messages": USER * 50_000}, 400, "context_length_exceeded",
     "maximum context length is 256", "messages"),
    ("past-context-window", CHAT, {**BASE, "messages": [{"role": "user", "content": "word " * 2000}]},
     400, "context_length_exceeded", "maximum context length is 256", "messages"),
    ("max-tokens-past-window", CHAT, {**BASE, "max_tokens": 10**30}, 400, "context_length_exceeded",
     "maximum context length is 256", "max_tokens"),
    ("overflow-1e999", CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": 1e999}'
     % TINY_MODEL_ID.encode(), 400, None, "finite", "temperature"),
    ("temperature-range", CHAT, {**BASE, "temperature": 2.5}, 400, None, "2", "temperature"),
    ("stop-token-id-huge", CHAT, {**BASE, "stop_token_ids": [10**20]}, 400, None, "vocabulary", "stop_token_ids"),
    ("stop-token-id-negative", "/v1/completions", {"model": TINY_MODEL_ID, "prompt": "x", "stop_token_ids": [-1]},
     400, None, "greater than or equal to 0", "stop_token_ids.0"),
    ("logit-bias-out-of-range", CHAT, {**BASE, "logit_bias": {"5": 1e300}}, 400, None, "[-100, 100]",
     "logit_bias"),
    ("logit-bias-huge-id", CHAT, {**BASE, "logit_bias": {str(10**30): 1}}, 400, None, "vocabulary", "logit_bias"),
    ("seed-huge", CHAT, {**BASE, "seed": 2**64}, 400, None, "seed", "seed"),
    ("n-huge", CHAT, {**BASE, "n": 10**6}, 400, None, "n", "n"),
    ("wrong-type-messages", CHAT, {**BASE, "messages": "Hello"}, 400, None, "messages", "messages"),
    ("wrong-type-max-tokens", CHAT, {**BASE, "max_tokens": "many"}, 400, None, "integer", "max_tokens"),
    ("wrong-type-stop", CHAT, {**BASE, "stop": {"a": 1}}, 400, None, "stop", "stop"),
    ("wrong-type-content", CHAT, {**BASE, "messages": [{"role": "user", "content": 7}]}, 400, None, "content",
     "messages.0.content"),
    ("unknown-role", CHAT, {**BASE, "messages": [{"role": "root", "content": "x"}]}, 400, None, "role",
     "messages.0.role"),
    ("thousands-of-stops", CHAT, {**BASE, "stop": [f"s{i}" for i in range(5000)]}, 400, None, "256", "stop"),
    ("tool-schema-invalid", CHAT, {**BASE, "tools": [tool({"type": "no-such-type"})]}, 400, None, "schema",
     "tools.0.function.parameters"),
    ("tool-schema-dangling-ref", CHAT, {**BASE, "tools": [tool({"$ref": "#/$defs/missing"})],
                                        "tool_choice": "required"}, 400, None, "", "tools"),
    ("response-format-self-ref", CHAT, {**BASE, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, 400, "invalid_grammar",
     "admits no output", "response_format"),
    ("completions-nested", "/v1/completions", nested(5000).replace(b"messages", b"prompt"), 400, "invalid_json",
     "nested", None),
    ("lm-v2-nan", "/lm/v2/chat/completions", b'{"model": "%s", "messages": [], "top_p": NaN}' % TINY_MODEL_ID.encode(),
     400, "invalid_json", "NaN", None),
]


def send(url: str, route: str, body: dict | bytes, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + route, content=content, headers={"content-type": "application/json"}, timeout=timeout)


@pytest.mark.parametrize(("route", "body", "status", "code", "words", "param"),
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_hostile_input_gets_its_status_and_message(tiny_app, route, body, status, code, words, param):
    started = time.monotonic()
    resp = send(tiny_app, route, body)
    assert resp.status_code == status, resp.text[:500]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    assert time.monotonic() - started < 20  # answered, not hung


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_before_it_is_read_whole(tiny_app, chunked):
    sent = 0

    def body():  # a generator: httpx sends it chunked, without a Content-Length
        nonlocal sent
        for _ in range(64):  # 16 MiB in all, 4x the limit
            sent += 256 * 1024
            yield b" " * (256 * 1024)

    content = body() if chunked else b" " * (LIMIT + 1)
    try:
        resp = httpx.post(tiny_app + CHAT, content=content, headers={"content-type": "application/json"}, timeout=60)
    except httpx.WriteError:  # the server answered and closed before the client finished sending
        return
    assert resp.status_code == 413, resp.text[:300]
    assert resp.json()["error"]["code"] == "request_too_large"
    assert str(LIMIT) in resp.json()["error"]["message"]


def test_nothing_crashes_hangs_or_leaks_between_requests(tiny_app):
    """A greedy stream runs while every hostile case is sent: its text equals the same
    request alone; afterwards the worker is the same process and holds no sequence."""
    pid = worker_stats("tiny", TINY_MODEL_ID).pid
    victim = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Tell me a story"}],
              "temperature": 0, "max_tokens": 200, "ignore_eos": True}
    alone = send(tiny_app, CHAT, victim).json()["choices"][0]["message"]["content"]
    during: dict[str, str] = {}
    thread = threading.Thread(target=lambda: during.update(
        text=send(tiny_app, CHAT, victim).json()["choices"][0]["message"]["content"]))
    thread.start()
    answers = [send(tiny_app, route, body).status_code for _, route, body, *_ in CASES]
    thread.join(timeout=120)
    assert answers and all(status == 400 for status in answers), answers
    assert during["text"] == alone
    deadline = time.time() + 10
    while (stats := worker_stats("tiny", TINY_MODEL_ID)).running + stats.waiting and time.time() < deadline:
        time.sleep(0.2)
    assert stats.pid == pid
    assert stats.running == stats.waiting == 0


def test_a_recursive_schema_is_served_within_max_tokens(tiny_app):
    body = {**BASE, "max_tokens": 24, "response_format": {
        "type": "json_schema", "json_schema": {"name": "list", "schema": recursive_schema()}}}
    resp = send(tiny_app, CHAT, body)
    assert resp.status_code == 200, resp.text[:300]
    assert resp.json()["usage"]["completion_tokens"] <= 24
