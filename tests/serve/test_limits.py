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


TIMED_MODEL = "tiny-timed"  # a tiny model with a 1,024-token window under a 0.2 s request limit
TIMED_TOKENS = 1000  # ~0.8 s of decoding on a fast 2-core Xeon: far past the limit on any machine


@pytest.fixture(scope="module")
def limits_app(serve_instance, tiny_model_dir, tmp_path_factory):
    """One app, two models: the tiny model behind a one-request worker with a one-request
    queue, and a tiny model with a longer window and a 0.2 s request limit (an app deploy
    fewer than one each). The window lets a request ask for 4x the tokens the 256-token one
    could: 240 of them took 0.2 s on an AMX Xeon, so the limit was not always reached."""
    from tests.support.tiny_models import write_tiny_model_dir

    args = tiny_app_args(tiny_model_dir)
    small_queue = args["models"][0]
    long_window = write_tiny_model_dir(tmp_path_factory.mktemp("tiny_timed"), max_position_embeddings=1024)
    timed = {**small_queue, "id": TIMED_MODEL, "source": str(long_window),
             "engine": {**small_queue["engine"], "request_timeout_s": 0.2, "max_model_len": 1024,
                        "kv_cache_memory_gib": 0.01},
             "deployment": dict(small_queue["deployment"])}
    small_queue["deployment"] = {**small_queue["deployment"], "max_ongoing_requests": 1, "max_queued_requests": 1}
    args["models"].append(timed)
    serve.run(build_app(args), name="limits", route_prefix="/limits", blocking=False)
    url = serve_instance.url("/limits")
    wait_ready(url)
    yield url
    delete_app("limits")


def test_full_queue_answers_503_with_retry_after(limits_app):
    body = {**BODY, "max_tokens": 120}

    def send(_):
        return httpx.post(limits_app + "/v1/chat/completions", json=body, timeout=60)

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
        status = httpx.post(limits_app + "/v1/chat/completions", json={**BODY, "max_tokens": 2},
                            timeout=60).status_code
        time.sleep(0.2 if status != 200 else 0)
    assert status == 200


def test_request_timeout_is_504_and_frees_the_cache(limits_app):
    body = {**BODY, "model": TIMED_MODEL}
    resp = httpx.post(limits_app + "/v1/chat/completions", json={**body, "max_tokens": TIMED_TOKENS}, timeout=60)
    assert resp.status_code == 504, resp.text
    assert resp.json()["error"]["code"] == "request_timeout"
    with httpx.stream("POST", limits_app + "/v1/chat/completions",
                      json={**body, "max_tokens": TIMED_TOKENS, "stream": True}, timeout=60) as stream:
        lines = [line for line in stream.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "request_timeout"  # after streaming began
    stats = worker_stats("limits", TIMED_MODEL)
    assert stats.active_requests == 0 and stats.kv_blocks_used == 0
