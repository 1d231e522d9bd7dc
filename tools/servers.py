"""Waiting for a server the tools started (loopback only) to answer `GET /v1/models`."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_ready(url: str, timeout_s: float = 300, process: subprocess.Popen | None = None) -> None:
    """Return once `url` serves its model list; raise if `process` (when given) exits first
    or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} before it came up ({url})")
        try:
            if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s")
