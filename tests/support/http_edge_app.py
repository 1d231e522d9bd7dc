"""Run by tests/serve/test_http_edge.py in a process of its own: Serve's HTTP edge is chosen
by environment variables read when Ray starts (the Makefile's SERVE_ENV: HAProxy on the
HTTP port, in front of each ingress replica's own port), so this starts its own Ray with
them, serves the tiny model with API keys, and prints one JSON object of what the test checks.

    <SERVE_ENV with free ports> CHATSERVE_EDGE_PORT=P python -m tests.support.http_edge_app
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import httpx

KEY = "sk-http-edge-check"
MESSAGES = [{"role": "user", "content": "Hello! How can I assist you today?"}]


def main() -> None:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.support.serve_fixtures import (
        TINY_MODEL_ID,
        tiny_app_args,
        wait_ready,
        worker_stats,
    )
    from tests.support.tiny_models import write_tiny_model_dir

    os.environ["CHATSERVE_EDGE_TEST_KEYS"] = KEY
    args = tiny_app_args(write_tiny_model_dir(Path(tempfile.mkdtemp(prefix="chatserve-edge-")) / "tiny"))
    args["server"] = {"api_keys_env": "CHATSERVE_EDGE_TEST_KEYS"}
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    edge_port = int(os.environ["CHATSERVE_EDGE_PORT"])
    serve.start(http_options={"host": "127.0.0.1", "port": edge_port})
    edge = f"http://127.0.0.1:{edge_port}"  # HAProxy
    try:
        serve.run(build_app(args), name="edge", route_prefix="/", blocking=False)
        replica = f"http://127.0.0.1:{os.environ['RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT']}"
        auth = {"Authorization": f"Bearer {KEY}"}
        wait_ready(edge, timeout=180, headers=auth)
        body = {"model": TINY_MODEL_ID, "messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        result = {
            "unauthorized": httpx.post(edge + "/v1/chat/completions", json=body, timeout=60).status_code,
            "edge_text": _text(edge, body, auth),
            "replica_text": _text(replica, body, auth),
            "edge_stream_text": _stream_text(edge, body, auth),
        }
        _leave_a_stream(edge, body, auth)  # the client leaves: HAProxy must pass that on
        result["after_disconnect"] = _settled(lambda: worker_stats("edge", TINY_MODEL_ID))
        print("RESULT " + json.dumps(result), flush=True)
    finally:
        # This process started its Ray, so ray.shutdown() ends every actor of it (HAProxy
        # included); serve.shutdown() first would wait about 30 s for HAProxy to drain.
        ray.shutdown()


def _text(url: str, body: dict, headers: dict) -> str:
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    resp.raise_for_status()
    return resp.json()["choices"][0]["message"]["content"]


def _stream_text(url: str, body: dict, headers: dict) -> str:
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=dict(body, stream=True), headers=headers,
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                parts.extend(c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"])
    return "".join(parts)


def _leave_a_stream(url: str, body: dict, headers: dict) -> None:
    long_body = dict(body, stream=True, max_tokens=200, ignore_eos=True)
    with httpx.stream("POST", url + "/v1/chat/completions", json=long_body, headers=headers, timeout=60) as resp:
        assert next(resp.iter_lines()).startswith("data: ")


def _settled(stats_of, timeout: float = 20) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = stats_of()
        if (stats.active_requests == 0 and stats.kv_blocks_used == 0) or time.time() > deadline:
            return {"active_requests": stats.active_requests, "kv_blocks_used": stats.kv_blocks_used}
        time.sleep(0.2)


if __name__ == "__main__":
    main()
