"""`make serve`'s start, end to end on the tiny model: `python -m serve_app.launch CONFIG` with
the Makefile's SERVE_ENV (HAProxy in front of the ingress replicas' own ports) runs chatserve
unchanged (keys, answers, streams, a client that leaves: its request is aborted on the
worker), in a Ray of its own without the dashboard's modules, and SIGTERM stops all of it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import yaml

from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import (
    TINY_MODEL_ID,
    free_port,
    tiny_app_args,
    wait_ready,
)
from tests.support.tiny_models import write_tiny_model_dir
from tools.bench.compare import DEFAULT_EDGE, EDGES, SERVE_ENV, serve_command

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
    started: dict[int, str] = {}
    try:
        edge, replica = f"http://127.0.0.1:{edge_port}", f"http://127.0.0.1:{replica_port}"
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_ready(edge, timeout=240, headers=auth)
        started = descendants(launcher.pid)
        assert not [cmd for cmd in started.values() if cmd.startswith(DASHBOARD_MODULE)], started
        assert any("gcs_server" in cmd for cmd in started.values()), started  # its own Ray, not a running one

        body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        assert httpx.post(edge + "/v1/chat/completions", json=body, timeout=60).status_code == 401
        edge_text = chat_text(edge, body, auth)
        assert edge_text and edge_text == chat_text(replica, body, auth) == stream_text(edge, body, auth)
        leave_a_stream(edge, body, auth)  # the client leaves: HAProxy must pass that on
        assert settled(edge, auth) == {"running": 0.0, "kv_usage": 0.0}
    finally:
        started = started or descendants(launcher.pid)
        os.kill(launcher.pid, signal.SIGTERM)
        launcher.wait(timeout=90)
        log.close()
        left = wait_gone(started)
        for pid in left:  # never leave a cluster behind, whatever the assertions said
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
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


def descendants(root: int) -> dict[int, str]:
    """Every live process below `root`: pid -> command line."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in found:
                found[pid] = commands[pid]
                frontier.append(pid)
    return found


def wait_gone(processes: dict[int, str], timeout: float = 30) -> list[int]:
    """The pids of `processes` still running (zombies aside) after up to `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        left = [pid for pid in processes if running(pid)]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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
        text = httpx.get(url + "/metrics", headers=headers, timeout=10).text
        found = {name: gauge(text, metric) for name, metric in
                 (("running", "chatserve_running_sequences"), ("kv_usage", "chatserve_kv_cache_usage_ratio"))}
        if not any(found.values()) or time.time() > deadline:
            return found
        time.sleep(0.2)


def gauge(metrics_text: str, name: str) -> float:
    for line in metrics_text.splitlines():
        if line.startswith(name + "{") and f'model="{TINY_MODEL_ID}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {TINY_MODEL_ID} not in /metrics")
