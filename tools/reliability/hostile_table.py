"""The hostile-input run of docs/RELIABILITY.md, as a table: every case the CI tests send
(tests/reliability/test_hostile_inputs.py, the bad images of tests/serve/test_vision_serve.py, API keys
that differ only in length or case), answered by one app on loopback that has API keys
and a media directory, with its status, error code, param, message and time.

    python -m tools.reliability.hostile_table > /tmp/hostile.md

It ends with the worker's pid and sequences before and after: the same process, none left.
Exits 1 when an answer is not the status the tests expect.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

KEY = "sk-hostile-Qw3rTy7uI9oP"
SEND_TIMEOUT_S = 60


def main() -> int:
    import ray
    from ray import serve

    from serve_app.app import build_app
    from tests.reliability.test_hostile_inputs import CASES, LIMIT
    from tests.serve.test_vision_serve import BAD_IMAGES, PNG, VLM_ID
    from tests.support.serve_fixtures import (
        TINY_MODEL_ID,
        free_port,
        tiny_app_args,
        wait_ready,
        worker_stats,
    )
    from tests.support.tiny_models import write_tiny_model_dir
    from tests.support.tiny_vlm import write_tiny_vlm_dir

    root = Path(tempfile.mkdtemp(prefix="chatserve-hostile-"))
    media = root / "media"
    media.mkdir()
    (media / "test.png").write_bytes(PNG)
    (media / "notes.png").write_bytes(b"plain text, not an image")
    (root / "outside.png").write_bytes(PNG)
    (root / "keys").write_text(KEY + "\n")
    args = tiny_app_args(write_tiny_model_dir(root / "text"))
    args["models"].append(dict(copy.deepcopy(args["models"][0]), id=VLM_ID, source=str(write_tiny_vlm_dir(root / "vlm"))))
    args["server"] = {"api_keys_file": str(root / "keys"),
                      "media": {"directory": str(media), "allow_remote": True, "allowed_hosts": ["127.0.0.0/8"]}}

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    wrong = 0
    try:
        serve.run(build_app(args), name="hostile", route_prefix="/", blocking=False)
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout=300, headers={"Authorization": f"Bearer {KEY}"})
        before = worker_stats("hostile", TINY_MODEL_ID)
        print("| input | route | status | code | param | message (first 100 characters) | ms |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for name, route, body, status, *_ in CASES:
            wrong += row(name, route, status, lambda r=route, b=body: post(url, r, b))
        for name, content in [("over-limit, Content-Length", b" " * (LIMIT + 1)), ("over-limit, chunked", chunks())]:
            wrong += row(name, "/v1/chat/completions", 413, lambda c=content: post(url, "/v1/chat/completions", c))
        for image_url, _ in BAD_IMAGES:
            wrong += row(f"image {short(image_url)}", "/v1/chat/completions", 400,
                         lambda i=image_url: post(url, "/v1/chat/completions", image_body(VLM_ID, i)))
        hello = {"model": TINY_MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for name, header, status in auth_cases():
            wrong += row(name, "/v1/chat/completions", status,
                         lambda h=header: post(url, "/v1/chat/completions", hello, header=h))
        after = worker_stats("hostile", TINY_MODEL_ID)
        print(f"\nworker pid {before.pid} -> {after.pid}; sequences after: running {after.running}, "
              f"waiting {after.waiting}, active {after.active_requests}; KV blocks in use {after.kv_blocks_used}")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 1 if wrong else 0


def post(url: str, route: str, body, header: str | None = "default") -> httpx.Response:
    headers = {"content-type": "application/json"}
    if header == "default":
        headers["Authorization"] = f"Bearer {KEY}"
    elif header is not None:
        headers["Authorization"] = header
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(url + route, content=content, headers=headers, timeout=SEND_TIMEOUT_S)


def row(name: str, route: str, expected: int, send) -> int:
    """Print one answer; 1 when its status is not the expected one."""
    started = time.perf_counter()
    try:
        resp = send()
        status, error = resp.status_code, (resp.json().get("error") or {}) if resp.status_code != 200 else {}
    except httpx.WriteError:  # answered and closed before the whole body went out (the 413 path)
        status, error = "closed", {"message": "the server closed the connection while the body was sent"}
    ms = (time.perf_counter() - started) * 1000
    message = str(error.get("message", "")).replace("|", "/").replace("\n", " ")[:100]
    print(f"| {name} | `{route}` | {status} | {error.get('code')} | {error.get('param')} | {message} | {ms:.0f} |")
    return int(status != expected and not (expected == 413 and status == "closed"))


def chunks():
    for _ in range(64):  # 16 MiB, sent chunked (no Content-Length)
        yield b" " * (256 * 1024)


def image_body(model: str, image_url) -> dict:
    content = [{"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": image_url}]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def short(image_url) -> str:
    text = image_url if isinstance(image_url, str) else image_url["url"]
    return text if len(text) < 48 else text[:40] + "…"


def auth_cases() -> list[tuple[str, str | None, int]]:
    return [
        ("auth: the key", f"Bearer {KEY}", 200),
        ("auth: no header", None, 401),
        ("auth: key upper-cased", f"Bearer {KEY.upper()}", 401),
        ("auth: key one short", f"Bearer {KEY[:-1]}", 401),
        ("auth: key one longer", f"Bearer {KEY}x", 401),
        ("auth: key without Bearer", KEY, 401),
    ]


if __name__ == "__main__":
    sys.exit(main())
