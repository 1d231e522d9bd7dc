"""Autoscaling that scales: under load the worker goes from 1 to 2 replicas, then back."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ray import serve

from serve_app.app import build_app, worker_deployment_name
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
)

BODY = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 200,
        "ignore_eos": True}


@pytest.fixture(scope="module")
def autoscaled_app(serve_instance, tiny_model_dir):
    args = tiny_app_args(tiny_model_dir)
    args["models"][0]["deployment"]["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2,
        "upscale_delay_s": 1, "downscale_delay_s": 3, "metrics_interval_s": 0.5, "look_back_period_s": 2,
    }
    serve.run(build_app(args), name="auto", route_prefix="/auto", blocking=False)
    url = serve_instance.url("/auto")
    wait_ready(url)
    yield url
    delete_app("auto")


def running_replicas() -> int:
    status = serve.status().applications["auto"].deployments[worker_deployment_name(TINY_MODEL_ID)]
    return status.replica_states.get("RUNNING", 0)


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.5)
    return False


def test_worker_scales_up_under_load_and_back_down(autoscaled_app):
    assert running_replicas() == 1
    stop = threading.Event()
    failures: list[int] = []

    def client() -> None:
        with httpx.Client(timeout=60) as http:
            for _ in range(200):  # bounded; the test stops it much sooner
                if stop.is_set():
                    return
                status = http.post(autoscaled_app + "/v1/chat/completions", json=BODY).status_code
                if status != 200:
                    failures.append(status)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        # (a replica starts in ~10 s alone; beside the in-process half of `make test`, several times that)
        scaled_up = wait_for(lambda: running_replicas() == 2, timeout=150)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert scaled_up, "8 concurrent clients with target_ongoing_requests=2 did not add a replica"
    assert failures == []
    assert wait_for(lambda: running_replicas() == 1, timeout=60), "no scale-down after the load stopped"
