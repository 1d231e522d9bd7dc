"""Integration: Ray Serve + ingress + worker on the tiny model, over HTTP and the openai client."""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from tests.support.serve_fixtures import TINY_MODEL_ID, worker_stats

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

MESSAGES = [{"role": "user", "content": "Hello! How can I assist you today?"}]


@pytest.fixture(scope="module")
def client(tiny_app):
    return openai.OpenAI(base_url=tiny_app + "/v1", api_key="unused", max_retries=0)


def post(url: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(url + "/v1/chat/completions", content=content,
                      headers={"content-type": "application/json"}, timeout=60, **kw)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY_MODEL_ID]
    assert models.data[0].model_extra["max_model_len"] == 256


def test_health_names_each_models_ready_replicas(tiny_app):
    resp = httpx.get(tiny_app + "/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "models": {TINY_MODEL_ID: {"ready_replicas": 1, "ready": True}}}


def test_non_streaming_greedy_is_deterministic_with_exact_usage(client):
    kwargs = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=12,
                  extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert first.object == "chat.completion"
    assert first.choices[0].message.role == "assistant"
    assert first.choices[0].message.content == second.choices[0].message.content
    assert first.choices[0].finish_reason == "length"
    assert first.usage.completion_tokens == 12
    assert first.usage.total_tokens == first.usage.prompt_tokens + 12
    # prefill_time and one decode time per later token (MindIE fields).
    assert first.model_extra["prefill_time"] > 0
    assert len(first.model_extra["decode_time_arr"]) == 11


def test_prompt_tokens_are_the_templated_prompt(client, tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = len(tiny_tokenizer(text, add_special_tokens=False)["input_ids"])
    assert expected > 10
    out = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=2, temperature=0)
    assert out.usage.prompt_tokens == expected


def test_streaming_matches_non_streaming(client):
    kwargs = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=10,
                  extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_raw_sse_ends_with_done(tiny_app):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "stream": True, "max_tokens": 3}
    with httpx.stream("POST", tiny_app + "/v1/chat/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)


def test_stop_string_cuts_output(client):
    base = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=20,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**base).choices[0].message.content
    assert len(full) > 6
    stop = full[3:6]
    cut = client.chat.completions.create(stop=[stop], **base)
    assert cut.choices[0].message.content == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].model_extra["stop_reason"] == stop
    kept = client.chat.completions.create(**{**base, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                          stop=stop)
    assert kept.choices[0].message.content == full[: full.index(stop) + len(stop)]


def test_streamed_stop_string_never_leaks(client):
    base = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=20,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**base).choices[0].message.content
    stop = full[4:7]
    chunks = list(client.chat.completions.create(stream=True, stop=stop, **base))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full[: full.index(stop)]


def test_seeded_sampling_is_reproducible(client):
    kwargs = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=1.0, max_tokens=12, seed=1234,
                  extra_body={"ignore_eos": True})
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    b = client.chat.completions.create(**kwargs).choices[0].message.content
    other = client.chat.completions.create(**{**kwargs, "seed": 99}).choices[0].message.content
    assert a == b
    assert a != other


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MESSAGES}, 400, "model"),
        ({"model": TINY_MODEL_ID, "messages": []}, 400, "messages"),
        ({"model": TINY_MODEL_ID, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "temperature": 2.5}, 400, "temperature"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "top_p": 0}, 400, "top_p"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": "many"}, 400, "max_tokens"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "stream_options": {"include_usage": True}}, 400, None),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "presence_penalty": 2.5}, 400, "presence_penalty"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "n": 2, "temperature": 0}, 400, "n"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "logit_bias": {"5": 101}}, 400, "logit_bias"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "min_tokens": 9, "max_tokens": 3}, 400, "min_tokens"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "repetition_penalty": 0}, 400, "repetition_penalty"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "min_p": 1.5}, 400, "min_p"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "use_beam_search": True}, 400, "n"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "use_beam_search": True, "n": 2, "temperature": 0.5}, 400, "temperature"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "use_beam_search": True, "n": 2, "top_k": 5}, 400, "top_k"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "use_beam_search": True, "n": 3, "best_of": 2}, 400, "best_of"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "length_penalty": 0.5}, 400, "length_penalty"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f g"}}]},
         400, "tools.0.function.name"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "stop": ["x"] * 300}, 400, "stop"),
        ({"model": TINY_MODEL_ID, "messages": MESSAGES, "stop": ["ok", ""]}, 400, "stop"),
        ({"model": "no-such-model", "messages": MESSAGES}, 404, "model"),
    ],
)
def test_invalid_requests(tiny_app, body, status, param):
    resp = post(tiny_app, body)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]


def test_invalid_json_is_400(tiny_app):
    resp = post(tiny_app, b"{not json")
    assert resp.status_code == 400
    assert "JSON" in resp.json()["error"]["message"]


def test_context_window_overflow_names_the_numbers(tiny_app):
    resp = post(tiny_app, {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 1000})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert "256" in message and "1000" in message
    assert resp.json()["error"]["param"] == "max_tokens"


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, temperature=-1)


def test_concurrent_requests_share_the_batch(client):
    from concurrent.futures import ThreadPoolExecutor

    kwargs = dict(model=TINY_MODEL_ID, messages=MESSAGES, temperature=0, max_tokens=16,
                  extra_body={"ignore_eos": True})
    alone = client.chat.completions.create(**kwargs).choices[0].message.content
    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: client.chat.completions.create(**kwargs), range(8)))
    assert all(o.choices[0].message.content == alone for o in outs)
    assert all(o.usage.completion_tokens == 16 for o in outs)


def test_client_disconnect_frees_the_sequence(tiny_app):
    body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "stream": True, "max_tokens": 200,
            "ignore_eos": True}
    with httpx.stream("POST", tiny_app + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
    # The stream is closed after one event; the worker must drop the request and its blocks.
    deadline = time.time() + 20
    while time.time() < deadline:
        stats = worker_stats("tiny", TINY_MODEL_ID)
        if stats.active_requests == 0 and stats.kv_blocks_used == 0:
            break
        time.sleep(0.2)
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0, stats


def test_cached_tokens_in_usage_for_a_repeated_prefix(client, tiny_app):
    """The second request with the same long prefix reports the prefix-cache hit in
    usage.prompt_tokens_details.cached_tokens (non-streaming, streaming and /v1/completions)."""
    messages = [{"role": "system", "content": f"{uuid.uuid4().hex} Unicode: café naïve 你好 世界 — a system prompt."},
                {"role": "user", "content": "Hi"}]
    kwargs = dict(model=TINY_MODEL_ID, messages=messages, temperature=0, max_tokens=2)
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # The first request may share a block or so with an earlier test's system prompt (the
    # template's opening); the second finds all of its prompt but the last token.
    assert first.usage.prompt_tokens_details.cached_tokens < cached
    assert cached == second.usage.prompt_tokens - 1
    stream = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == cached
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    body = {"model": TINY_MODEL_ID, "prompt": prompt, "max_tokens": 2}
    httpx.post(tiny_app + "/v1/completions", json=body, timeout=60).raise_for_status()
    usage = httpx.post(tiny_app + "/v1/completions", json=body, timeout=60).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_worker_calls_go_over_grpc_by_value(tiny_app):
    """The ingress reaches workers over Serve's gRPC channel (worker_call.over_grpc; faster per
    streamed chunk than Ray object refs, docs/BENCHMARKS.md) and the chunks arrive whole."""
    from ray import serve

    from serve_app.app import worker_deployment_name
    from serve_app.transport.worker_call import over_grpc
    from workers.contract.chunks import GenerationChunk
    from workers.contract.requests import GenerateRequest
    from workers.contract.sampling_params import SamplingParams

    handle = over_grpc(serve.get_deployment_handle(worker_deployment_name(TINY_MODEL_ID), app_name="tiny"))
    assert handle.handle_options._by_reference is False
    request = GenerateRequest(request_id="grpc-check", messages=MESSAGES, max_tokens=5,
                              params=SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    messages = list(handle.options(stream=True).generate.remote(request))
    assert all(isinstance(message, list) for message in messages)  # a worker message: the chunks pending then
    chunks = [chunk for message in messages for chunk in message]
    assert all(isinstance(chunk, GenerationChunk) for chunk in chunks)
    assert sum(len(chunk.token_ids) for chunk in chunks) == 5
    assert chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 5


def test_requests_come_back_by_the_ingress_channel(client, tiny_app):
    """The ingress keeps one channel open to the worker replica, and requests' chunks go by
    it (serve_app/transport/): not by their own calls, once it is open."""
    deadline = time.monotonic() + 30
    while worker_stats("tiny", TINY_MODEL_ID).open_channels < 1:
        assert time.monotonic() < deadline, "the ingress never opened a channel to the worker"
        time.sleep(0.2)
    before = worker_stats("tiny", TINY_MODEL_ID)
    for stream in (False, True):
        out = client.chat.completions.create(model=TINY_MODEL_ID, messages=MESSAGES, max_tokens=4, stream=stream)
        if stream:
            list(out)
    after = worker_stats("tiny", TINY_MODEL_ID)
    assert after.open_channels == 1
    assert after.requests_by_channel - before.requests_by_channel == 2
    assert after.requests_by_call == before.requests_by_call
