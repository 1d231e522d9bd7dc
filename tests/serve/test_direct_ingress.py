"""`make serve-direct`: Ray Serve's direct ingress (the ingress replica serves HTTP itself,
no proxy hop) runs chatserve unchanged: keys, answers, streams, and a client that leaves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import free_port

ROOT = REPO_ROOT


def test_direct_ingress_serves_the_app_as_the_proxy_does():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    env.update(RAY_SERVE_ENABLE_DIRECT_INGRESS="1", RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(port),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(port + 20), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "tests.support.direct_ingress_app"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["unauthorized"] == 401
    assert result["direct_text"] and result["direct_text"] == result["proxy_text"] == result["direct_stream_text"]
    assert result["after_disconnect"] == {"active_requests": 0, "kv_blocks_used": 0}
