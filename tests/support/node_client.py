"""OpenAI's Node SDK as a test client: scripts in tests/clients/node/, run with `node`.

The SDK is installed by npm into tests/clients/node/node_modules on first use (pinned in
its package.json); tests that use the `node_sdk` fixture skip where node or npm is missing
or npm cannot reach its registry.
Each script reads OPENAI_BASE_URL, OPENAI_API_KEY and MODEL, and prints one JSON document.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parents[1] / "clients" / "node"


class NodeSDK:
    def run(self, script: str, base_url: str, model: str, timeout: float = 120, **env: str):
        """Runs tests/clients/node/<script> and returns the JSON it printed."""
        environment = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "none",
                       "MODEL": model, **env}
        done = subprocess.run(["node", script], cwd=NODE_DIR, env=environment, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0, f"node {script} failed:\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])


def _install() -> None:
    installed = NODE_DIR / "node_modules" / "openai" / "package.json"
    wanted = json.loads((NODE_DIR / "package.json").read_text())["dependencies"]["openai"]
    if installed.exists() and json.loads(installed.read_text())["version"] == wanted:
        return
    subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--no-package-lock"],
                   cwd=NODE_DIR, check=True, capture_output=True, timeout=300)


@pytest.fixture(scope="session")
def node_sdk() -> NodeSDK:
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node and npm are not installed: the Node SDK tests need them")
    try:
        _install()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as failure:
        # The registry out of reach is the machine's state, not the server's: skip, saying so.
        pytest.skip(f"npm could not install the Node SDK: {failure}")
    return NodeSDK()
