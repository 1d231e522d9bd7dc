"""A real Ray Serve instance on loopback for integration tests (started once per session)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import httpx
import pytest

TINY_MODEL_ID = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeInstance:
    base_url: str

    def url(self, prefix: str) -> str:
        return f"{self.base_url}{prefix}"


def tiny_app_args(model_dir, **engine) -> dict:
    engine_config = {"block_size": 4, "kv_cache_memory_gib": 0.002, "max_num_seqs": 16,
                     "max_num_batched_tokens": 64, "max_model_len": 256, "torch_threads": 1}
    engine_config.update(engine)
    return {
        "models": [{
            "id": TINY_MODEL_ID,
            "source": str(model_dir),
            # The tests' references are float32 transformers runs; `auto` would pick
            # bfloat16 on a CPU with AMX (test_cpu_linear.py covers that path).
            "dtype": "float32",
            "engine": engine_config,
            "deployment": {"max_ongoing_requests": 64, "ray_actor_options": {"num_cpus": 0}},
        }],
        "ingress": {"ray_actor_options": {"num_cpus": 0}},
    }


def soak_app_args(model_root) -> dict:
    """The tiny app with a 4k window: the soak's tool request (its tool list and the call
    format in the system prompt) needs about 2k tiny-tokenizer tokens."""
    from tests.support.tiny_models import write_tiny_model_dir

    model_dir = write_tiny_model_dir(model_root, max_position_embeddings=4096)
    return tiny_app_args(model_dir, max_model_len=4096, kv_cache_memory_gib=0.02)


def run_app(serve_instance: ServeInstance, name: str, args: dict) -> str:
    """Start chatserve with `args` as app `name` at /<name>; its URL once it answers."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=name, route_prefix=f"/{name}", blocking=False)
    url = serve_instance.url(f"/{name}")
    wait_ready(url)
    return url


def delete_app(name: str) -> None:
    """Delete a module's app without waiting out its replicas' graceful shutdown (about 3 s
    an app): the next module's app deploys meanwhile, and its own name never clashes."""
    from ray import serve

    serve.delete(name, _blocking=False)


def wait_ready(url: str, timeout: float = 120, headers: dict[str, str] | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url + "/v1/models", headers=headers, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


# Read by the Ray processes ray.init starts (they inherit this process's environment):
# - autoscaling metrics every 0.5 s instead of 10 s, so the autoscaling tests run in seconds;
# - no task events, no event-loop stats and the Serve controller's loop every 0.5 s: Ray's
#   idle periodic work as under `make serve` (an idle test cluster with one app: 5.2 % of the
#   two cores with the controller at Ray's 0.1 s, 2.8 % at 0.5 s; an app deploys as fast).
TEST_CLUSTER_ENV = {
    "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
    "RAY_task_events_report_interval_ms": "0",
    "RAY_event_stats": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # Ray's log monitor streams worker output to drivers (the tests' log_to_driver is off); it
    # re-lists the session's log files every 0.1 s below 1,000 files: 33 CPU-s of a suite
    # run (an app deployed and deleted leaves its replicas' files). Every 5 s here.
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    # The replicas at normal priority, as under `make serve` (Ray's default nice 15): beside
    # the in-process half of `make test` they were starved (an app deploy 10 s alone, 40 s
    # there), and this half is the longer one.
    "RAY_worker_niceness": "0",
}


@pytest.fixture(scope="session")
def serve_instance():
    import ray
    from ray import serve

    port = free_port()
    for name, value in TEST_CLUSTER_ENV.items():
        os.environ.setdefault(name, value)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield ServeInstance(f"http://127.0.0.1:{port}")
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_app(serve_instance, tiny_model_dir):
    """The chatserve app on the tiny random model, at route prefix /tiny."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(tiny_app_args(tiny_model_dir)), name="tiny", route_prefix="/tiny", blocking=False)
    url = serve_instance.url("/tiny")
    wait_ready(url)
    return url


def worker_stats(app_name: str, model_id: str):
    from ray import serve

    from serve_app.app import worker_deployment_name

    handle = serve.get_deployment_handle(worker_deployment_name(model_id), app_name=app_name)
    return handle.stats.remote().result()
