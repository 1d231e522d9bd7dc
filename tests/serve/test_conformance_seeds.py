"""Conformance: the vendor documents' own request samples, model name swapped, sent
unchanged to chatserve; each answer must have the documented shape.

Sources: shared/seeds/001_*.txt (MindIE request samples, Chinese), 003_*.txt (MaaS
Python and OpenAI SDK examples), 004_*.txt (the /lm/v2 dialect), and the stream
samples of 000_*.txt / 002_*.txt for the fullTextEnabled shape.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from serve_app.dialects.chat.output import ChunkStreamer
from serve_app.dialects.chat.request import ChatCompletionRequest
from tests.support.serve_fixtures import tiny_app_args, wait_ready
from tests.support.sse_events import sse_payloads
from tests.support.tiny_models import write_tiny_model_dir
from workers.contract.chunks import GenerationChunk

MODEL = "DeepSeek-R1"  # the seeds' model name; the conformance app serves the tiny model under it

SEED_001_SINGLE_TURN = {
    "model": "DeepSeek-R1",
    "messages": [{"role": "user", "content": "You are a helpful assistant."}],
    "stream": False,
    "presence_penalty": 1.03,
    "frequency_penalty": 1.0,
    "repetition_penalty": 1.0,
    "temperature": 0.5,
    "top_p": 0.95,
    "top_k": 0,
    "seed": None,
    "stop": ["stop1", "stop2"],
    "stop_token_ids": [2, 13],
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "ignore_eos": False,
    "max_tokens": 20,
}

SEED_001_MULTIMODAL = {
    **SEED_001_SINGLE_TURN,
    "messages": [{"role": "user", "content": [
        {"type": "text", "text": "My name is Olivier and I"},
        {"type": "image_url", "image_url": "/xxxx/test.png"},
    ]}],
}

DELIVERY_TOOL = {  # seed 001, request samples 1 and 2 (also used by the default-model e2e test)
    "type": "function",
    "function": {
        "name": "get_delivery_date",
        "strict": True,
        "description": "Get the delivery date for a customer's order. Call this whenever you need to know the "
                       "delivery date, for example when a customer asks 'Where is my package'",
        "parameters": {
            "type": "object",
            "properties": {"order_id": {"type": "string", "description": "The customer's order ID."}},
            "required": ["order_id"],
            "additionalProperties": False,
        },
    },
}

SEED_001_TOOLS_1 = {
    "model": "DeepSeek-R1",
    "messages": [
        {"role": "system", "content": "You are a helpful customer support assistant. Use the supplied tools to assist the user."},
        {"role": "user", "content": "Hi, can you tell me the delivery date for my order? my order id is 12345."},
    ],
    "stream": False, "presence_penalty": 1.03, "frequency_penalty": 1.0, "repetition_penalty": 1.0,
    "temperature": 0.5, "top_p": 0.95, "top_k": 0, "seed": None, "stop": ["stop1", "stop2"],
    "stop_token_ids": [2], "ignore_eos": False, "max_tokens": 1024,
    "tools": [DELIVERY_TOOL], "tool_choice": "auto",
}

# Request sample 2: the same conversation after the call, with the tool's result.
SEED_001_TOOLS_2 = {
    "model": "DeepSeek-R1",
    "messages": [
        {"role": "system", "content": "You are a helpful customer support assistant. Use the supplied tools to assist the user."},
        {"role": "user", "content": "Hi, can you tell me the delivery date for my order? my order id is 12345."},
        {"role": "assistant", "tool_calls": [{"function": {"arguments": "{\"order_id\": \"12345\"}",
                                                           "name": "get_delivery_date"},
                                              "id": "tool_call_8p2Nk", "type": "function"}]},
        {"role": "tool", "content": "the delivery date is 2024.09.10.", "tool_call_id": "tool_call_8p2Nk"},
    ],
    "stream": False, "repetition_penalty": 1.1, "temperature": 0.9, "top_p": 1, "max_tokens": 1024,
    "tools": [DELIVERY_TOOL], "tool_choice": "auto",
}

SEED_003_MAAS_PYTHON = {
    "model": "DeepSeek-R1",
    "max_tokens": 20,
    "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello"}],
    "stream": False,
    "temperature": 1.0,
}

SEED_004_LM_V2 = {"model": "your-api-name", "messages": [{"role": "user", "content": "介绍一下北京"}],
                  "max_completion_tokens": 10}
SEED_004_LM_V2_STREAM = {"model": "service12345", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture(scope="module")
def seed_app(serve_instance, tmp_path_factory):
    """The tiny model with a window large enough for the seeds' caps, served under the seeds'
    model names (one worker deployment: served_model_name)."""
    from ray import serve

    from serve_app.app import build_app

    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("seed_model"), max_position_embeddings=4200)
    args = tiny_app_args(model_dir, max_model_len=4200, kv_cache_memory_gib=0.02)
    args["models"][0].update(id="seed-model", served_model_name=[MODEL, "your-api-name", "service12345"])
    serve.run(build_app(args), name="seeds", route_prefix="/seeds", blocking=False)
    url = serve_instance.url("/seeds")
    wait_ready(url, timeout=180)
    return url


def post(url: str, route: str, body: dict) -> httpx.Response:
    return httpx.post(url + route, json=body, timeout=120)


def check_chat_completion(body: dict, model: str, cap: int) -> None:
    assert body["object"] == "chat.completion"
    assert body["id"] and isinstance(body["created"], int) and body["model"] == model
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert 1 <= usage["completion_tokens"] <= cap
    assert body["prefill_time"] > 0  # MindIE extras (seed 001 response samples)
    assert len(body["decode_time_arr"]) == usage["completion_tokens"] - 1


def test_each_served_name_is_listed_and_reaches_the_one_model(seed_app):
    names = [MODEL, "your-api-name", "service12345"]
    listed = httpx.get(seed_app + "/v1/models", timeout=30).json()["data"]
    assert [card["id"] for card in listed] == names
    assert len({card["max_model_len"] for card in listed}) == 1
    assert httpx.get(f"{seed_app}/v1/models/service12345", timeout=30).json()["id"] == "service12345"
    # The config id is not a served name once served_model_name is set.
    missing = httpx.post(seed_app + "/v1/chat/completions", json={**SEED_004_LM_V2, "model": "seed-model"}, timeout=30)
    assert missing.status_code == 404 and all(name in missing.json()["error"]["message"] for name in names)


def test_seed_001_single_turn(seed_app):
    resp = post(seed_app, "/v1/chat/completions", SEED_001_SINGLE_TURN)
    assert resp.status_code == 200, resp.text
    check_chat_completion(resp.json(), MODEL, 20)


def test_seed_001_single_turn_streamed(seed_app):
    body = dict(SEED_001_SINGLE_TURN, stream=True)
    with httpx.stream("POST", seed_app + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    # The role once, in the first delta, as OpenAI (seed 000's MindIE stream repeats it; so
    # does chatserve with server.full_text_enabled, below).
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_seed_003_maas_python_request(seed_app):
    resp = post(seed_app, "/v1/chat/completions", SEED_003_MAAS_PYTHON)
    assert resp.status_code == 200, resp.text
    check_chat_completion(resp.json(), MODEL, 20)


def test_seed_003_openai_sdk_example(seed_app):
    """The SDK example verbatim: temperature 0.6, top_p 0.7, max_tokens 4096, stream=True."""
    client = openai.OpenAI(base_url=seed_app + "/v1", api_key="yourApiKey", max_retries=0)
    completion = client.chat.completions.create(
        model="DeepSeek-R1",
        messages=[{"role": "user", "content": "Which number is larger, 9.11 or 9.8?"}],
        temperature=0.6, top_p=0.7, max_tokens=4096, stream=True,
    )
    pieces = [chunk.choices[0].delta.content for chunk in completion if chunk.choices]
    assert any(pieces)
    assert all(p is None or isinstance(p, str) for p in pieces)


def test_seed_004_lm_v2_request(seed_app):
    resp = post(seed_app, "/lm/v2/chat/completions", SEED_004_LM_V2)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "chat.completion" and body["model"] == "your-api-name"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("normal", "length", "stop")
    assert body["usage"]["completion_tokens"] <= 10


def test_seed_004_lm_v2_stream(seed_app):
    body = dict(SEED_004_LM_V2_STREAM, max_completion_tokens=8)  # the sample sets no cap; keep the test short
    with httpx.stream("POST", seed_app + "/lm/v2/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["usage"] is None for c in chunks)  # no include_usage: usage stays null


@pytest.mark.parametrize("sample", [SEED_001_TOOLS_1, SEED_001_TOOLS_2], ids=["request-1", "request-2"])
def test_seed_001_tool_samples(seed_app, sample):
    """Both multi-turn tool samples are answered in the documented shape (response samples
    1 and 2). `get_delivery_date` is strict, so under `auto` any call the model writes must
    match its schema; the tiny random model answers in text or with such a call."""
    body = dict(sample, max_tokens=24)  # the samples ask for 1024; keep the test short
    resp = post(seed_app, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] in ("stop", "length", "tool_calls")
    for call in choice["message"].get("tool_calls") or []:
        assert call["type"] == "function" and call["function"]["name"] == "get_delivery_date"
        assert set(json.loads(call["function"]["arguments"])) == {"order_id"}
    if choice["finish_reason"] != "tool_calls":
        assert isinstance(choice["message"]["content"], str)
    assert body["usage"]["completion_tokens"] <= 24


def test_seed_001_tool_sample_1_with_a_forced_call(seed_app):
    """Sample 1 with `tool_choice` naming the function: the grammar forces the call. Its
    `order_id` is an unbounded string, which the random model may not close within the
    cap: then the answer is cut (`length`) inside the forced call, which is neither content
    nor a call."""
    body = dict(SEED_001_TOOLS_1, max_tokens=120, seed=0,
                tool_choice={"type": "function", "function": {"name": "get_delivery_date"}})
    resp = post(seed_app, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    if choice["finish_reason"] == "length":
        assert choice["message"]["content"] is None and "tool_calls" not in choice["message"]
        return
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_delivery_date"
    assert isinstance(json.loads(call["function"]["arguments"])["order_id"], str)


def test_seed_001_multimodal_sample_is_refused_by_a_text_only_model(seed_app):
    """The seed app serves a text-only model: the multimodal sample gets a 400 naming the
    image part (never a silently image-less answer). A vision model answers it:
    tests/serve/test_vision_serve.py."""
    resp = post(seed_app, "/v1/chat/completions", SEED_001_MULTIMODAL)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages.0.content.1.image_url"


def test_full_text_enabled_stream_matches_seed_000_shape():
    """Seed 000 'Streamed Inference 2': every delta carries the whole text so far; the last
    chunk adds full_text and usage."""
    req = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    streamer = ChunkStreamer("endpoint_common_11", req, full_text_enabled=True)
    pieces = ["Hello", "!", " How", " can", " I", " assist", " you", " today", "?"]
    chunks = [GenerationChunk(text=p, prompt_tokens=31, completion_tokens=i + 1) for i, p in enumerate(pieces)]
    chunks[-1].finish_reason = "length"
    payloads = sse_payloads(streamer, chunks)
    expected = ["Hello", "Hello!", "Hello! How", "Hello! How can", "Hello! How can I", "Hello! How can I assist",
                "Hello! How can I assist you", "Hello! How can I assist you today", "Hello! How can I assist you today?"]
    assert [p["choices"][0]["delta"]["content"] for p in payloads] == expected
    assert all(p["choices"][0]["delta"]["role"] == "assistant" for p in payloads)
    last = payloads[-1]
    assert last["full_text"] == "Hello! How can I assist you today?"
    assert last["usage"] == {"prompt_tokens": 31, "completion_tokens": 9, "total_tokens": 40}
    assert last["choices"][0]["finish_reason"] == "length"
    assert all("full_text" not in p and "usage" not in p for p in payloads[:-1])
