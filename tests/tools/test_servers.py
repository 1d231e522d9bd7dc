"""tools/servers.stop_session: a stopped server leaves none of its processes behind, even one
that moved to a process group of its own (as Ray's HAProxy does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tools.servers import session_members, stop_session

# A "server" that ignores SIGINT's group by starting a grandchild in its own process group.
SERVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_stop_session_kills_a_member_in_its_own_process_group():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    grandchild = int(server.stdout.readline())
    assert os.getpgid(grandchild) != server.pid  # out of the server's group, still in its session
    assert set(session_members(server.pid)) >= {server.pid, grandchild}
    stop_session(server, grace_s=5)
    deadline = time.monotonic() + 5
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)
    assert session_members(server.pid) == []
