"""`make serve`'s HTTP edge (HAProxy in front of the ingress replicas' own ports, started by
the Makefile's SERVE_ENV) runs chatserve unchanged: keys, answers, streams, and a client
that leaves (its request is aborted on the worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO_ROOT
from tests.support.serve_fixtures import free_port
from tools.bench.compare import DEFAULT_EDGE, EDGES, SERVE_ENV


def test_make_serves_edge_serves_the_app_as_its_replicas_do():
    edge_port, replica_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a Ray of its own
    env.update(SERVE_ENV)
    env.update(EDGES[DEFAULT_EDGE][0])
    env.update(RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT=str(replica_port),
               RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT=str(replica_port + 20),
               CHATSERVE_EDGE_PORT=str(edge_port), PYTHONPATH=str(REPO_ROOT))
    run = subprocess.run([sys.executable, "-m", "tests.support.http_edge_app"], cwd=REPO_ROOT, env=env,
                         capture_output=True, text=True, timeout=400)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["unauthorized"] == 401
    assert result["edge_text"] and result["edge_text"] == result["replica_text"] == result["edge_stream_text"]
    assert result["after_disconnect"] == {"active_requests": 0, "kv_blocks_used": 0}
