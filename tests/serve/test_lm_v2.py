"""The `/lm/v2/chat/completions` dialect (seed 004): translation and shapes as unit tests,
then its rules, finish reasons and streams over HTTP on the tiny model."""

from __future__ import annotations

import json

import httpx
import pytest

from serve_app.dialects.lm_v2 import (
    FINISH_REASONS,
    LmV2Accumulator,
    LmV2ChatRequest,
    LmV2Streamer,
    finish_reason,
    to_generate_request,
)
from serve_app.http.errors import APIError
from tests.support.serve_fixtures import TINY_MODEL_ID
from tests.support.sse_events import sse_lines
from workers.contract.chunks import ErrorInfo, GenerationChunk

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MESSAGES = [{"role": "user", "content": "Hello! How can I assist you today?"}]
ROUTE = "/lm/v2/chat/completions"


def make(**fields) -> LmV2ChatRequest:
    return LmV2ChatRequest.model_validate({"model": TINY_MODEL_ID, "messages": MESSAGES, **fields})


# ------------------------------------------------------------------------ translation


def test_defaults_are_the_dialects():
    gen = to_generate_request(make(), "req-1")
    p = gen.params
    assert gen.request_id == "req-1" and gen.prompt is None
    assert (p.temperature, p.top_p, p.top_k) == (0.95, 0.8, 0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert p.stop == () and not p.ignore_eos and p.n == 1
    assert gen.max_tokens is None  # the model's default_max_tokens (the worker applies it)
    assert gen.messages == MESSAGES


def test_null_means_default():
    nulls = dict(temperature=None, top_p=None, top_k=None, penalty_score=None, presence_penalty=None,
                 frequency_penalty=None, max_completion_tokens=None, stop=None)
    assert to_generate_request(make(**nulls), "r") == to_generate_request(make(), "r")


def test_fields_map_to_sampling_params():
    gen = to_generate_request(
        make(temperature=0.3, top_p=0.5, top_k=7, penalty_score=1.7, presence_penalty=-1.5,
             frequency_penalty=2.0, max_completion_tokens=9, stop="END"),
        "r",
    )
    p = gen.params
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.5, 7)
    assert p.repetition_penalty == 1.7  # penalty_score is the multiplicative repetition penalty
    assert (p.presence_penalty, p.frequency_penalty) == (-1.5, 2.0)
    assert gen.max_tokens == 9
    assert p.stop == ("END",)
    assert to_generate_request(make(stop=["a", "bc"]), "r").params.stop == ("a", "bc")


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_values(top_k):
    assert to_generate_request(make(top_k=top_k), "r").params.top_k == 0


def test_top_p_zero_is_greedy():
    p = to_generate_request(make(top_p=0), "r").params
    assert p.top_k == 1 and p.top_p == 1.0  # the sampler needs top_p > 0
    assert p.greedy


def test_function_role_reaches_the_template_as_tool():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling get_weather"},
        {"role": "function", "name": "get_weather", "content": "sunny"},
    ]
    gen = to_generate_request(make(messages=messages), "r")
    assert gen.messages == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "calling get_weather"},
        {"role": "tool", "name": "get_weather", "content": "sunny"},
    ]


@pytest.mark.parametrize(
    ("worker_reason", "stop_reason", "expected"),
    [
        (None, None, None),
        ("stop", None, "normal"),  # EOS
        ("stop", 2, "normal"),  # a stop token id (EOS listed as one)
        ("stop", "END", "stop"),  # a stop string
        ("length", None, "length"),
        ("abort", None, "abort"),
    ],
)
def test_finish_reason_mapping(worker_reason, stop_reason, expected):
    assert finish_reason(GenerationChunk(finish_reason=worker_reason, stop_reason=stop_reason)) == expected
    assert expected is None or expected == "abort" or expected in FINISH_REASONS


def test_reserved_finish_reasons_are_listed():
    assert set(FINISH_REASONS) == {"normal", "stop", "length", "content_filter", "tool_calls"}


# --------------------------------------------------------------------- shaping (unit)


def _events(req: LmV2ChatRequest, chunks: list[GenerationChunk]) -> list[str]:
    return sse_lines(LmV2Streamer("id-1", req), chunks)


CHUNKS = [
    GenerationChunk(text="<think>", prompt_tokens=5, completion_tokens=1),
    GenerationChunk(text="", prompt_tokens=5, completion_tokens=2),  # held back: no event
    GenerationChunk(text="hm</think>ok", prompt_tokens=5, completion_tokens=4),
    GenerationChunk(text="", finish_reason="stop", prompt_tokens=5, completion_tokens=5),
]


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_shape(include_usage):
    req = make(stream=True, stream_options={"include_usage": include_usage})
    events = _events(req, CHUNKS)
    assert events[-1] == "data: [DONE]\n\n"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(set(p) == {"id", "object", "created", "model", "choices", "usage"} for p in payloads)
    assert all(p["object"] == "chat.completion.chunk" and p["id"] == "id-1" for p in payloads)
    assert payloads[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                       "finish_reason": None}]
    assert [p["choices"][0]["delta"] for p in payloads[1:]] == [
        {"content": "<think>"}, {"content": "hm</think>ok"}, {"content": ""}]
    assert [p["choices"][0]["finish_reason"] for p in payloads] == [None, None, None, "normal"]
    assert all(p["usage"] is None for p in payloads[:-1])
    last_usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10} if include_usage else None
    assert payloads[-1]["usage"] == last_usage


def test_stream_error_after_start_is_a_last_event():
    error = GenerationChunk(error=ErrorInfo(500, "engine died", type="server_error", code="engine_dead"))
    events = _events(make(stream=True), [CHUNKS[0], error])
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "engine_dead"
    assert events[-1] == "data: [DONE]\n\n"


def test_accumulated_response_shape():
    acc = LmV2Accumulator("id-2", TINY_MODEL_ID)
    for chunk in CHUNKS[:-1] + [GenerationChunk(text="!", finish_reason="stop", stop_reason="!!",
                                                prompt_tokens=5, completion_tokens=5)]:
        acc.add(chunk)
    body = json.loads(acc.result().dump_json())
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "<think>hm</think>ok!"},
                                "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}


def test_worker_errors_name_the_dialects_fields():
    acc = LmV2Accumulator("id-3", TINY_MODEL_ID)
    with pytest.raises(APIError) as info:
        acc.add(GenerationChunk(error=ErrorInfo(400, "too long", param="max_tokens", code="context_length_exceeded")))
    assert info.value.param == "max_completion_tokens"


# ---------------------------------------------------------------------------- over HTTP


def post(url: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + ROUTE, content=content, headers={"content-type": "application/json"}, timeout=60, **kw)


def stream_payloads(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + ROUTE, json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


GREEDY = {"model": TINY_MODEL_ID, "messages": MESSAGES, "top_k": 1}

TWO_TURNS = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES}, 400, "model"),
        ({"model": TINY_MODEL_ID}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": []}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": TWO_TURNS}, 400, "messages"),  # even count
        ({"model": TINY_MODEL_ID, "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "system", "content": "x"}]}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                               {"role": "user", "content": "c"}]}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": TWO_TURNS + [{"role": "assistant", "content": "x"}]}, 400, "messages"),
        ({**GREEDY, "temperature": 0}, 400, "temperature"),
        ({**GREEDY, "temperature": 1.01}, 400, "temperature"),
        ({**GREEDY, "temperature": -0.5}, 400, "temperature"),
        ({**GREEDY, "top_p": 1.5}, 400, "top_p"),
        ({**GREEDY, "top_p": -0.1}, 400, "top_p"),
        ({**GREEDY, "penalty_score": 0.9}, 400, "penalty_score"),
        ({**GREEDY, "penalty_score": 2.1}, 400, "penalty_score"),
        ({**GREEDY, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({**GREEDY, "frequency_penalty": -3}, 400, "frequency_penalty"),
        ({**GREEDY, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
        ({**GREEDY, "stop": [""]}, 400, "stop"),
        ({**GREEDY, "stream_options": {"include_usage": True}}, 400, None),  # without stream
        ({**GREEDY, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),  # over the window (worker)
        ({**GREEDY, "model": "no-such-model"}, 404, "model"),
    ],
)
def test_rules(tiny_app, body, status, param):
    resp = post(tiny_app, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]


def test_invalid_json_is_400(tiny_app):
    resp = post(tiny_app, b"{not json")
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"


def test_response_shape_and_length(tiny_app):
    resp = post(tiny_app, {**GREEDY, "max_completion_tokens": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["model"] == TINY_MODEL_ID
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert set(choice) == {"index", "message", "finish_reason"}
    assert choice["index"] == 0 and set(choice["message"]) == {"role", "content"}
    assert choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 2
    assert usage["total_tokens"] == usage["prompt_tokens"] + 2 and usage["prompt_tokens"] > 0


def test_multi_turn_and_function_messages_are_accepted(tiny_app):
    messages = TWO_TURNS + [{"role": "function", "name": "f", "content": "42"}]
    resp = post(tiny_app, {**GREEDY, "messages": messages, "max_completion_tokens": 2})
    assert resp.status_code == 200, resp.text


def test_greedy_is_deterministic_and_top_p_zero_is_greedy(tiny_app):
    body = {**GREEDY, "max_completion_tokens": 12}
    first = post(tiny_app, body).json()["choices"][0]["message"]["content"]
    assert post(tiny_app, body).json()["choices"][0]["message"]["content"] == first
    by_top_p = {k: v for k, v in body.items() if k != "top_k"} | {"top_p": 0}
    assert post(tiny_app, by_top_p).json()["choices"][0]["message"]["content"] == first


def test_stop_string_finish_reason(tiny_app):
    full = post(tiny_app, {**GREEDY, "max_completion_tokens": 20}).json()["choices"][0]
    text = full["message"]["content"]
    assert len(text) > 6, full
    stop = text[3:6]
    cut = post(tiny_app, {**GREEDY, "max_completion_tokens": 20, "stop": [stop]}).json()["choices"][0]
    assert cut["message"]["content"] == text[: text.index(stop)]
    assert cut["finish_reason"] == "stop"


def test_penalties_are_accepted(tiny_app):
    body = {**GREEDY, "max_completion_tokens": 3, "penalty_score": 1.3, "presence_penalty": 0.5,
            "frequency_penalty": 0.5}
    resp = post(tiny_app, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 3


def test_stream_without_usage(tiny_app):
    body = {**GREEDY, "max_completion_tokens": 6}
    whole = post(tiny_app, body).json()
    payloads = stream_payloads(tiny_app, body)
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert len({p["id"] for p in payloads}) == 1
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in p["choices"][0]["delta"] for p in payloads[1:])
    assert all("usage" in p and p["usage"] is None for p in payloads)
    text = "".join(p["choices"][0]["delta"]["content"] for p in payloads)
    assert text == whole["choices"][0]["message"]["content"]
    reasons = [p["choices"][0]["finish_reason"] for p in payloads]
    assert reasons[-1] == whole["choices"][0]["finish_reason"]
    assert all(r is None for r in reasons[:-1])


def test_stream_usage_only_on_the_last_chunk(tiny_app):
    # Tokens that reach the worker's loop together go out as one event (a loaded machine
    # can batch a few of the tiny model's 2 ms steps): 24 tokens leave several events.
    body = {**GREEDY, "max_completion_tokens": 24}
    whole = post(tiny_app, body).json()
    assert whole["usage"]["completion_tokens"] == 24  # no early EOS: the stream below has text to split
    payloads = stream_payloads(tiny_app, {**body, "stream_options": {"include_usage": True}})
    assert len(payloads) >= 3
    assert all(p["usage"] is None for p in payloads[:-1])
    assert payloads[-1]["usage"] == whole["usage"]
    assert payloads[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
