"""Back-pressure and timeouts through Serve: bounded queues answer 503 + Retry-After, never
hang or 500; a request past its time limit ends with 504 and frees its cache."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from ray import serve

from serve_app.app import build_app
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
    worker_stats,
)

BODY = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


def deploy(serve_instance, name: str, args: dict) -> str:
    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    url = serve_instance.url(f"/{name}")
    wait_ready(url)
    return url


@pytest.fixture(scope="module")
def small_queue_app(serve_instance, tiny_model_dir):
    args = tiny_app_args(tiny_model_dir)
    args["models"][0]["deployment"].update(max_ongoing_requests=1, max_queued_requests=1)
    yield deploy(serve_instance, "bp", args)
    delete_app("bp")


@pytest.fixture(scope="module")
def timeout_app(serve_instance, tiny_model_dir):
    yield deploy(serve_instance, "slowlimit", tiny_app_args(tiny_model_dir, request_timeout_s=0.2))
    delete_app("slowlimit")


def test_full_queue_answers_503_with_retry_after(small_queue_app):
    body = {**BODY, "max_tokens": 120}

    def send(_):
        return httpx.post(small_queue_app + "/v1/chat/completions", json=body, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(send, range(8)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) <= {200, 503}, codes
    assert 200 in codes and 503 in codes, codes
    for r in responses:
        if r.status_code == 503:
            assert r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "overloaded"
    # Once the load is gone the same app serves again: within seconds, as the router's
    # count of the replica's ongoing requests settles after the last answer went out.
    deadline, status = time.monotonic() + 15, None
    while status != 200 and time.monotonic() < deadline:
        status = httpx.post(small_queue_app + "/v1/chat/completions", json={**BODY, "max_tokens": 2},
                            timeout=60).status_code
        time.sleep(0.2 if status != 200 else 0)
    assert status == 200


def test_request_timeout_is_504_and_frees_the_cache(timeout_app):
    resp = httpx.post(timeout_app + "/v1/chat/completions", json={**BODY, "max_tokens": 240}, timeout=60)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", timeout_app + "/v1/chat/completions", json={**BODY, "max_tokens": 240, "stream": True},
                      timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"  # after streaming began
    stats = worker_stats("slowlimit", TINY_MODEL_ID)
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0
