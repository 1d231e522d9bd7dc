"""Servers the tools start (loopback only): waiting for `GET /v1/models`, and stopping them
with everything they started."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from tools.procfs import process_ids, stat_fields


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


def session_members(session_id: int) -> list[int]:
    """Process ids in the session `session_id` (Linux /proc). Ray starts HAProxy and its
    workers in process groups of their own, so a server's process group misses them while
    its session (start_new_session=True) still holds them."""
    members = []
    for pid in process_ids():
        fields = stat_fields(f"/proc/{pid}/stat")
        if fields is not None and int(fields[3]) == session_id and fields[0] != "Z":
            members.append(pid)
    return members


def stop_session(process: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop a server started with start_new_session=True: SIGINT its process group, then
    SIGKILL whatever of its session is left (an orphaned HAProxy otherwise keeps port 8000)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    for pid in session_members(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
