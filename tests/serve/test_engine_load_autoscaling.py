"""Autoscaling on the engine's load: three long prompts, far below any request-count target,
fill a small KV pool, and the worker goes from 1 to 2 replicas, then back to 1."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray
from ray import serve
from ray.serve._private.common import DeploymentID
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

from serve_app.app import build_app, worker_deployment_name
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    delete_app,
    tiny_app_args,
    wait_ready,
    worker_stats,
)

APP = "engine-load"
CLIENTS = 3


def long_chat(client: int) -> dict:
    """~190 prompt tokens (the tiny tokenizer makes ~20 of a sentence) + 40 generated: 58 of
    the pool's 78 blocks. Each client's own prefix, so the prefix cache shares no block."""
    text = f"Client {client}: " + "The quick brown fox jumps over the lazy dog. " * 9
    return {"model": TINY_MODEL_ID, "max_tokens": 40, "ignore_eos": True,
            "messages": [{"role": "user", "content": text}]}


@pytest.fixture(scope="module")
def engine_load_app(serve_instance, tiny_model_dir):
    # 0.00015 GiB of float32 K/V for the tiny model: 78 blocks of 4 tokens, room for one such
    # request at a time; the others wait with their prompts queued.
    args = tiny_app_args(tiny_model_dir, kv_cache_memory_gib=0.00015)
    deployment = args["models"][0]["deployment"]
    deployment["graceful_shutdown_timeout_s"] = 2  # the removed replica's open channels hold it no longer
    deployment["autoscaling_config"] = {
        "min_replicas": 1, "max_replicas": 2, "upscale_delay_s": 1, "downscale_delay_s": 3,
        "metrics_interval_s": 0.5, "look_back_period_s": 2,
        "engine_load": {"waiting_per_replica": 1, "kv_cache_usage": 0.5, "queued_prompt_tokens_per_replica": 200},
    }
    serve.run(build_app(args), name=APP, route_prefix="/" + APP, blocking=False)
    url = serve_instance.url("/" + APP)
    wait_ready(url)
    yield url
    delete_app(APP)


def replicas() -> int:
    """Replicas Serve keeps (running or starting): its autoscaling decision, without waiting
    for a new replica to load its model (test_autoscaling.py sees one serve)."""
    status = serve.status().applications[APP].deployments[worker_deployment_name(TINY_MODEL_ID)]
    return sum(n for state, n in status.replica_states.items() if state != "STOPPING")


def ongoing_requests() -> float:
    """What request-count autoscaling scales on: the controller's ongoing requests of the worker."""
    controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
    worker = DeploymentID(name=worker_deployment_name(TINY_MODEL_ID), app_name=APP)
    return ray.get(controller._get_total_num_requests_for_deployment_for_testing.remote(worker))


def wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.25)
    return False


def test_few_long_prompts_scale_the_worker_up_and_back_down(engine_load_app):
    assert replicas() == 1
    stop = threading.Event()
    failures: list[int] = []

    def client(index: int) -> None:
        with httpx.Client(timeout=60) as http:
            for _ in range(500):  # bounded; the test stops it much sooner
                if stop.is_set():
                    return
                status = http.post(engine_load_app + "/v1/chat/completions", json=long_chat(index)).status_code
                if status != 200:
                    failures.append(status)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    try:
        loaded = wait_for(lambda: worker_stats(APP, TINY_MODEL_ID).waiting > 0, timeout=30)
        started = time.time()
        scaled_up = wait_for(lambda: replicas() == 2, timeout=30)
        up_s = time.time() - started
        seen_by_request_count = ongoing_requests()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert loaded, "three long prompts never filled the replica's KV pool"
    assert scaled_up, "the engine's load did not add a replica"
    # The 3 requests and the ingress's channel to each worker replica: far below request
    # count's default target (32); measured, a target of 8 keeps one replica under this load.
    assert seen_by_request_count <= CLIENTS + 2
    assert failures == []
    stopped = time.time()
    assert wait_for(lambda: replicas() == 1, timeout=30), "no scale-down after the load stopped"
    print(f"scaled up {up_s:.1f} s after the engine filled, down {time.time() - stopped:.1f} s after the load")
