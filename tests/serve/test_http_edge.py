"""`make serve`'s start, end to end on the tiny model: `python -m serve_app.launch CONFIG` with
the Makefile's SERVE_ENV (HAProxy in front of the ingress replicas' own ports) runs chatserve
unchanged (keys, answers, streams, a client that leaves: its request is aborted on the
worker), in a Ray of its own without the dashboard's modules, and SIGTERM stops all of it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    free_port,
    tiny_app_args,
    wait_ready,
)
from tests.support.tiny_models import write_tiny_model_dir
from tools.bench.compare import DEFAULT_EDGE, EDGES, SERVE_ENV, serve_command
from tools.procfs import read_text
from tools.servers import session_members, stop_session

KEY = "sk-http-edge-check"
MESSAGES = [{"role": "user", "content": "Hello! How can I assist you today?"}]
DASHBOARD_MODULE = "ray-dashboard-"  # the title of each dashboard module's process (NodeHead, JobHead, ...)


def test_make_serves_start_serves_the_app_as_its_replicas_do(tmp_path):
    edge_port, replica_port = free_port(), free_port()
    config = write_config(tmp_path, edge_port)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    env.update(SERVE_ENV)
    env.update(EDGES[DEFAULT_EDGE][0])
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(replica_port),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(replica_port + 20),
               CHATSERVE_EDGE_TEST_KEYS=KEY, PYTHONPATH=str(REPO_ROOT))
    log = open(tmp_path / "serve.log", "w")
    launcher = subprocess.Popen(serve_command(config), cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        edge, replica = f"http://127.0.0.1:{edge_port}", f"http://127.0.0.1:{replica_port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_ready(edge, timeout=240, headers=auth)
        commands = [read_text(f"/proc/{pid}/cmdline") for pid in session_members(launcher.pid)]
        assert not [cmd for cmd in commands if cmd.startswith(DASHBOARD_MODULE)], commands
        assert any("gcs_server" in cmd for cmd in commands), commands  # its own Ray, not a running one

        body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        assert httpx.post(edge + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        edge_text = chat_text(edge, body, auth)
        assert edge_text and edge_text == chat_text(replica, body, auth) == stream_text(edge, body, auth)
        leave_a_stream(edge, body, auth)  # the client leaves: HAProxy must pass that on
        assert settled(edge, auth) == {"running": 0.0, "kv_usage": 0.0}
    finally:
        os.kill(launcher.pid, signal.SIGTERM)
        left = session_left(launcher, timeout_s=90)
        stop_session(launcher)  # never leave a cluster behind, whatever the assertions said
        log.close()
    assert not left, (left, (tmp_path / "serve.log").read_text()[-3000:])


def write_config(tmp_path: Path, port: int) -> Path:
    args = tiny_app_args(write_tiny_model_dir(tmp_path / "tiny"))
    args["server"] = {"api_keys_env": "CHATSERVE_EDGE_TEST_KEYS"}
    config = {"proxy_location": "EveryNode", "http_options": {"host": "127.0.0.1", "port": port},
              "applications": [{"name": "edge", "route_prefix": "/", "import_path": "serve_app.app:build_app",
                                "args": args}]}
    path = tmp_path / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def session_left(process: subprocess.Popen, timeout_s: float) -> list[int]:
    """The processes of `process`'s session (everything the launcher started) still
    running after up to `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while (left := session_members(process.pid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def chat_text(url: str, body: dict, headers: dict) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def stream_text(url: str, body: dict, headers: dict) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), headers=headers,
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                parts.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return "".join(parts)


def leave_a_stream(url: str, body: dict, headers: dict) -> None:
    long_body = dict(body, stream=True, max_tokens=200, ignore_eos=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=long_body, headers=headers, timeout=60) as resp:
        assert next(resp.iter_lines()).startswith("data: ")


def settled(url: str, headers: dict, timeout: float = 20) -> dict[str, float]:
    """The model's running sequences and KV use by /metrics, once both are 0 (or at `timeout`)."""
    deadline = time.time() + timeout
    while True:
        found = {"running": gauge(url, headers, "chatserve_running_sequences"),
                 "kv_usage": gauge(url, headers, "chatserve_kv_cache_usage_ratio")}
        if not any(found.values()) or time.time() > deadline:
            return found
        time.sleep(0.2)


def gauge(url: str, headers: dict, name: str) -> float:
    text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels.get("model") == TINY_MODEL_ID:
                return sample.value
    raise AssertionError(f"{name} for {TINY_MODEL_ID} not in /metrics")
