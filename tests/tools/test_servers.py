"""tools/servers.stop_session: a stopped server leaves none of its processes behind, even one
that moved to a process group of its own (as Ray's HAProxy does)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tools.servers import session_members, stop_session

# A "server" whose child moves to a process group of its own, out of reach of a group kill.
SERVER = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], process_group=0)
print(child.pid, flush=True)
time.sleep(120)
"""


def test_stop_session_kills_a_member_in_its_own_process_group():
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    grandchild = int(server.stdout.readline())
    assert os.getpgid(grandchild) != server.pid  # out of the server's group, still in its session
    assert set(session_members(server.pid)) >= {server.pid, grandchild}
    stop_session(server, grace_s=5)
    deadline = time.monotonic() + 5  # a killed process leaves the list once it is a zombie
    while session_members(server.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert session_members(server.pid) == []
