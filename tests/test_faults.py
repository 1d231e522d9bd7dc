"""Faults: a worker replica killed mid-stream ends its streams with an error event, and
Serve's replacement serves the next request."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import ray
from ray import serve

from serve_app.app import build_app, worker_deployment_name
from tests.serve_fixtures import TINY_MODEL_ID, tiny_app_args, wait_ready

BODY = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "ignore_eos": True}


@pytest.fixture(scope="module")
def fault_app(serve_instance, tiny_model_dir):
    serve.run(build_app(tiny_app_args(tiny_model_dir)), name="fault", route_prefix="/fault", blocking=False)
    url = serve_instance.url("/fault")
    wait_ready(url)
    yield url
    serve.delete("fault")


def kill_worker_replica() -> None:
    prefix = f"SERVE_REPLICA::fault#{worker_deployment_name(TINY_MODEL_ID)}#"
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]
    assert names, "no worker replica found"
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=True)


def test_killed_worker_ends_the_stream_with_an_error_then_recovers(fault_app):
    body = {**BODY, "max_tokens": 240, "stream": True}
    with httpx.stream("POST", fault_app + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        kill_worker_replica()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    last = json.loads(rest[-2][6:])
    # 240 tokens take far longer than the kill: the stream ends with the error event.
    assert last["error"]["code"] == "worker_failed", last
    deadline = time.time() + 90
    while True:
        resp = httpx.post(fault_app + "/v1/chat/completions", json={**BODY, "max_tokens": 3}, timeout=30)
        if resp.status_code == 200:
            break
        assert resp.status_code in (500, 503), resp.text  # refused clearly while Serve replaces the replica
        assert time.time() < deadline, "the replacement replica never served"
        time.sleep(1)
    assert resp.json()["usage"]["completion_tokens"] == 3


def test_graceful_shutdown_lets_a_running_stream_finish(serve_instance, tiny_model_dir):
    import threading

    serve.run(build_app(tiny_app_args(tiny_model_dir)), name="drain", route_prefix="/drain", blocking=False)
    url = serve_instance.url("/drain")
    wait_ready(url)
    body = {**BODY, "max_tokens": 240, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        deleter = threading.Thread(target=serve.delete, args=("drain",))
        deleter.start()  # shutdown begins while the stream runs
        rest = [line for line in lines if line]
    deleter.join(timeout=60)
    assert rest[-1] == "data: [DONE]"
    finishes = [json.loads(line[6:])["choices"][0].get("finish_reason") for line in rest[:-1]
                if json.loads(line[6:]).get("choices")]
    assert finishes[-1] == "length"  # the whole answer, not an error
